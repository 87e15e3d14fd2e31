"""``TCPStore``: the client of a ``TCPStoreServer``, optionally hosting it (torch's API).

One socket per ``TCPStore`` object, one request at a time (a lock makes the client
thread-safe).  A blocking ``get``/``wait`` holds the lock until it is answered, so
threads that must wake each other through the store need their own ``TCPStore``
objects, as in torch.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

from chorus.errors import (
    ChorusError,
    InvalidArgumentError,
    ProtocolError,
    RendezvousError,
    StoreTimeoutError,
)
from chorus.net import connect_and_handshake, get_token, recv_exact
from chorus.store.base import (
    DEFAULT_TIMEOUT,
    Store,
    check_key,
    pair_up,
    timeout_error,
    to_value,
)
from chorus.store.tcp_server import TCPStoreServer
from chorus.wire.store_codec import (
    LENGTH_SIZE,
    Op,
    Request,
    Response,
    Status,
    pack_request,
    parse_length,
    parse_response,
)

# How much longer than a blocking call's own timeout the client waits for the server's
# answer (which comes at the deadline) before it gives the connection up.
_GRACE = 10.0
_MAX_MS = 1 << 62
_MAX_SOCKET_TIMEOUT = 1e7

_shared_lock = threading.Lock()
_shared_servers: dict[tuple[str, int], list] = {}  # multi_tenant: (host, port) -> [server, users]


def _connect_host(host: str) -> str:
    """Return the address a client uses to reach a server bound to ``host``."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _acquire_server(host: str, port: int, token, multi_tenant: bool) -> TCPStoreServer:
    if not multi_tenant or port == 0:
        return TCPStoreServer(host, port, token)
    with _shared_lock:
        entry = _shared_servers.get((host, port))
        if entry is None:
            entry = _shared_servers[(host, port)] = [TCPStoreServer(host, port, token), 0]
        entry[1] += 1
        return entry[0]


def _release_server(server: TCPStoreServer, port: int) -> None:
    with _shared_lock:
        entry = _shared_servers.get((server.host, port))
        if entry is not None and entry[0] is server:
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _shared_servers[(server.host, port)]
    server.close()


class TCPStore(Store):
    """A store served over TCP by ``host_name:port``.

    ``is_master=True`` starts a ``TCPStoreServer`` in this process bound to
    ``host_name`` (port 0: a free port; ``.port`` tells which) and, with
    ``wait_for_workers`` and ``world_size``, waits until ``world_size`` clients
    (this one included) have connected.  ``multi_tenant=True`` lets several masters in
    one process share the server of one port.  ``token`` (else $CHORUS_TOKEN) must match
    the server's.  Other torch keyword arguments (``use_libuv``, ...) are accepted and
    ignored.

    rank 0: store = TCPStore("10.0.0.1", 29500, 2, is_master=True); store.set("k", "v")
    rank 1: store = TCPStore("10.0.0.1", 29500, 2); store.get("k") -> b"v"
    """

    def __init__(self, host_name: str, port: int, world_size: int | None = None,
                 is_master: bool = False, timeout: timedelta | float = DEFAULT_TIMEOUT,
                 wait_for_workers: bool = True, multi_tenant: bool = False,
                 token: bytes | str | None = None, **ignored_torch_kwargs):
        super().__init__(timeout)
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise InvalidArgumentError(f"TCPStore port must be an int in 0..65535, got {port!r}")
        if port == 0 and not is_master:
            raise InvalidArgumentError(
                "TCPStore port 0 only works with is_master=True (the master picks a free "
                "port); clients must be given the master's real port"
            )
        self.host = host_name
        self.world_size = world_size
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False
        self._server: TCPStoreServer | None = None
        token = get_token(token)
        if is_master:
            self._server = _acquire_server(host_name, port, token, multi_tenant)
            port = self._server.port
        self.port: int = port
        try:
            self._sock = connect_and_handshake(_connect_host(host_name), port, token, b"store", self._timeout)
            if is_master and wait_for_workers and world_size:
                self.wait_for_workers(world_size)
        except BaseException:
            self.close()
            raise

    def wait_for_workers(self, world_size: int) -> None:
        """On the master: block until ``world_size`` clients (this one included) have
        connected, StoreTimeoutError after the store's timeout.  What ``wait_for_workers=True``
        does in the constructor, for a master that has something to do in between (rendezvous
        publishes a job's derived secret once the port is bound)."""
        if self._server is None:
            raise InvalidArgumentError("wait_for_workers: only the master (is_master=True) can wait for workers")
        joined = self._server.wait_for_clients(world_size, self._timeout)
        if joined < world_size:
            raise StoreTimeoutError(
                f"the TCPStore master on {self.host}:{self.port}: Timed out after {self._timeout:g}s "
                f"waiting for {world_size} clients but only {joined} connected; start the other "
                f"ranks, check that they use this MASTER_ADDR/MASTER_PORT, or raise the timeout"
            )

    # -- one request -----------------------------------------------------------------

    def _request(self, request: Request, wait_s: float | None = None) -> Response:
        """Send ``request`` and return the server's response (raises on TIMEOUT/ERROR)."""
        with self._lock:
            sock = self._sock
            if sock is None:
                raise ChorusError(
                    f"this TCPStore ({self.host}:{self.port}) is closed or lost its "
                    f"connection earlier; create a new one"
                )
            limit = (self._timeout if wait_s is None else wait_s) + _GRACE
            sock.settimeout(limit if limit < _MAX_SOCKET_TIMEOUT else None)
            try:
                sock.sendall(pack_request(request))
                n = parse_length(recv_exact(sock, LENGTH_SIZE))
                response = parse_response(recv_exact(sock, n))
            except (OSError, ProtocolError) as e:
                self._sock = None
                sock.close()
                if self._closed:
                    raise ChorusError(f"the TCPStore was closed during {request.op.name}") from e
                raise RendezvousError(
                    f"lost the connection to the store at {self.host}:{self.port} during "
                    f"{request.op.name} ({e}); the process hosting it (rank 0 or the "
                    f"launcher) may have exited - check its log"
                ) from e
        if response.status is Status.TIMEOUT:
            raise timeout_error(request.op.name.lower(),
                                [k.decode(errors="replace") for k in response.args],
                                response.number / 1000)
        if response.status is Status.ERROR:
            message = response.args[0].decode(errors="replace") if response.args else "error"
            raise InvalidArgumentError(message)
        return response

    def _blocking(self, op: Op, keys: list[str], timeout) -> Response:
        seconds = self._seconds(timeout)
        ms = int(min(seconds * 1000, _MAX_MS))
        args = tuple(check_key(k).encode() for k in keys)
        return self._request(Request(op, args, ms), wait_s=seconds)

    # -- the Store API ---------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key``."""
        self._request(Request(Op.SET, (check_key(key).encode(), to_value(value))))

    def get(self, key: str, timeout: timedelta | float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` for it."""
        return self._blocking(Op.GET, [key], timeout).args[0]

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to counter ``key``; return the new value."""
        return self._request(Request(Op.ADD, (check_key(key).encode(),), int(amount))).number

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return the resulting value."""
        args = (check_key(key).encode(), to_value(expected), to_value(desired))
        return self._request(Request(Op.COMPARE_SET, args)).args[0]

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key exists (StoreTimeoutError after ``timeout``)."""
        self._blocking(Op.WAIT, keys, timeout)

    def check(self, keys: list[str]) -> bool:
        """Return True if every key exists."""
        args = tuple(check_key(k).encode() for k in keys)
        return bool(self._request(Request(Op.CHECK, args)).number)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return True if it existed."""
        return bool(self._request(Request(Op.DELETE_KEY, (check_key(key).encode(),))).number)

    def num_keys(self) -> int:
        """Return the number of keys."""
        return self._request(Request(Op.NUM_KEYS)).number

    def multi_get(self, keys: list[str], timeout: timedelta | float | None = None) -> list[bytes]:
        """Return the values of ``keys`` (read together), waiting until all exist."""
        return list(self._blocking(Op.MULTI_GET, keys, timeout).args)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Set every ``keys[i]`` to ``values[i]`` at once."""
        args = tuple(x for k, v in pair_up(keys, values) for x in (k.encode(), v))
        self._request(Request(Op.MULTI_SET, args))

    def close(self) -> None:
        """Close the connection and, on the master, stop the server; idempotent."""
        self._closed = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in a get
            except OSError:
                pass
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        server, self._server = self._server, None
        if server is not None:
            _release_server(server, server.port)
