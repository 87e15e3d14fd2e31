"""Socket helpers shared by the store and the TCP transport.

Listening, connecting with retries, exact reads, and the blocking drivers of the
connection handshake (whose messages live in ``chorus.wire.handshake``).  The job token
comes from the caller, else the ``CHORUS_TOKEN`` environment variable (rendezvous passes
the secret it derives for a job on one host, ``chorus.host.secret``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable

from chorus import config
from chorus.errors import AuthenticationError, ProtocolError, RendezvousError
from chorus.wire.handshake import TOKEN_ADVICE, ClientHandshake, ServerHandshake

logger = logging.getLogger("chorus")

_warn_lock = threading.Lock()
_warned = False

# Connection errors that mean "nobody is listening yet" (or the network is not up yet):
# connect() keeps retrying these until its deadline.
_RETRYABLE = (ConnectionRefusedError, ConnectionResetError, ConnectionAbortedError,
              TimeoutError, socket.gaierror)
_RETRYABLE_ERRNOS = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENOENT, errno.EAGAIN,
                     errno.EADDRNOTAVAIL}


def get_token(token: bytes | str | None = None) -> bytes | None:
    """Return the job token as bytes: ``token`` if given, else $CHORUS_TOKEN, else None.

    A str is encoded as UTF-8; an empty value counts as no token.
    """
    if token is None:
        token = config.get("CHORUS_TOKEN")
    if isinstance(token, str):
        token = token.encode("utf-8")
    return bytes(token) if token else None


def warn_unauthenticated_once(what: str) -> None:
    """Log (once per process, on logger "chorus") that ``what`` runs without a token."""
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    logger.warning("chorus: no job token, so the %s is open to anyone who reaches its port; set the "
                   "same CHORUS_TOKEN on every rank (jobs on one host derive one: CHORUS_LOCAL_SECRET)", what)


def _addresses(host: str, port: int, passive: bool) -> list[tuple]:
    """Resolve ``host:port`` to getaddrinfo entries for TCP, IPv4 first."""
    flags = socket.AI_PASSIVE if passive else 0
    infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                               0, flags)
    return sorted(infos, key=lambda info: info[0] != socket.AF_INET)


def listen(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """Return a socket listening on ``host:port`` (port 0: a free port) with SO_REUSEADDR.

    Binds to ``host`` only; "" or "0.0.0.0" listen on every interface.  Raises
    RendezvousError when the address is in use or is not an address of this machine.
    """
    where = f"{host}:{port}"
    try:
        infos = _addresses(host, port, passive=True)
    except socket.gaierror as e:
        raise RendezvousError(
            f"cannot listen on {where}: cannot resolve {host!r} ({e}); use an address "
            f"of this machine (e.g. MASTER_ADDR=127.0.0.1 for a single host)"
        ) from e
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise RendezvousError(
                f"cannot listen on {where}: the address is already in use (another job, or "
                f"an earlier run that has not exited, holds it); pass `--master-port 0` to "
                f"pick a free port, or set another MASTER_PORT"
            ) from e
        raise RendezvousError(
            f"cannot listen on {where}: {e.strerror or e}; the host must be an address of "
            f"this machine (MASTER_ADDR names the host of rank 0 or of the launcher)"
        ) from e
    return sock


def _try_connect(info: tuple, timeout: float) -> socket.socket:
    family, kind, proto, _, addr = info
    sock = socket.socket(family, kind, proto)
    try:
        sock.settimeout(max(timeout, 0.001))
        sock.connect(addr)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    if family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """Return a blocking TCP socket connected to ``host:port`` with TCP_NODELAY set.

    Retries refused or unreachable connections (the server may not be up yet) with a
    short back-off until ``timeout`` seconds have passed, then raises RendezvousError.
    """
    start = time.monotonic()
    deadline = start + timeout
    delay = 0.005
    attempts = 0
    last_error = OSError(f"no address found for {host!r}")
    while True:
        attempts += 1
        try:
            for info in _addresses(host, port, passive=False):
                try:
                    return _try_connect(info, deadline - time.monotonic())
                except OSError as e:
                    last_error = e
        except socket.gaierror as e:
            last_error = e
        if not (isinstance(last_error, _RETRYABLE) or last_error.errno in _RETRYABLE_ERRNOS):
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.5)
    raise RendezvousError(
        f"could not connect to {host}:{port} (tried for {time.monotonic() - start:.1f}s of "
        f"the {timeout:g}s allowed, {attempts} attempts; "
        f"last error: {last_error}); check that rank 0 (or the launcher) is running and "
        f"that MASTER_ADDR/MASTER_PORT name its host and port"
    ) from last_error


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Read exactly ``n`` bytes; raise ConnectionError if the peer closes first.

    ``deadline`` (time.monotonic()): TimeoutError once it passes, however the bytes trickle
    in (a socket timeout alone bounds each read, not the whole)."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from the socket; raise ConnectionError if the peer closes first (and
    TimeoutError when ``deadline`` passes, see :func:`recv_exact`)."""
    got, n = 0, len(view)
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"got {got} of {n} expected bytes before the deadline")
            sock.settimeout(remaining)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(
                f"connection closed by the peer after {got} of {n} expected bytes"
            )
        got += k


@contextlib.contextmanager
def _socket_timeout(sock: socket.socket, timeout: float):
    previous = sock.gettimeout()
    sock.settimeout(timeout)
    try:
        yield
    finally:
        sock.settimeout(previous)


def _peer(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "the peer"
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else "the peer"


def _label(purpose: bytes) -> str:
    return f"{purpose.decode(errors='replace')} connection"


class Unanswered(ProtocolError):
    """The server closed the connection before answering the handshake: it shed it (no
    room while it handshakes a flood of connections; see Pending).  Worth trying again."""


def connect_and_handshake(host: str, port: int, token: bytes | None, purpose: bytes,
                          timeout: float) -> socket.socket:
    """``connect`` then ``client_handshake``, within ``timeout`` seconds in all; a
    connection the server sheds before answering is made again."""
    deadline = time.monotonic() + timeout
    while True:
        sock = connect(host, port, max(0.1, deadline - time.monotonic()))
        try:
            client_handshake(sock, token, purpose, max(1.0, deadline - time.monotonic()))
            return sock
        except Unanswered:
            sock.close()
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)
        except BaseException:
            sock.close()
            raise


def client_handshake(sock: socket.socket, token: bytes | None, purpose: bytes,
                     timeout: float) -> None:
    """Run the connecting side of the handshake; return once the server is accepted.

    Raises ProtocolError (wrong magic, version or purpose; no complete answer within
    ``timeout`` seconds in all) or AuthenticationError (token differs, or is set on one
    side only).
    """
    hs = ClientHandshake(token, purpose)
    deadline = time.monotonic() + timeout
    answered = False
    with _socket_timeout(sock, timeout):
        try:
            sock.sendall(hs.initial_bytes())
            while not hs.done:
                out = hs.receive(recv_exact(sock, hs.bytes_needed(), deadline))
                answered = True
                if out:
                    sock.sendall(out)
        except TimeoutError:
            raise ProtocolError(
                f"no handshake answer from {_peer(sock)} within {timeout:g}s: it is not a "
                f"chorus {purpose.decode(errors='replace')} endpoint, or it is overloaded"
            ) from None
        except ConnectionError as e:
            if not answered:
                raise Unanswered(f"{_peer(sock)} closed the {_label(purpose)} before it answered ({e})") from e
            raise ProtocolError(
                f"{_peer(sock)} closed the {_label(purpose)} during the handshake ({e}); "
                f"check that it is a chorus endpoint of the same version and job"
            ) from e
    if not hs.authenticated:
        warn_unauthenticated_once(_label(purpose))


def server_handshake(sock: socket.socket, token: bytes | None, purpose: bytes,
                     timeout: float, opened: Callable[[], None] | None = None) -> None:
    """Run the accepting side of the handshake; return once the client is accepted.
    ``opened()`` runs once the client's opening message (its HELLO) has arrived.

    Raises ProtocolError (wrong magic, version or purpose; a client silent or too slow to
    finish within ``timeout`` seconds in all, however it trickles its bytes) or
    AuthenticationError (bad proof, or a token on one side only).
    """
    hs = ServerHandshake(token, purpose)
    deadline = time.monotonic() + timeout
    with _socket_timeout(sock, timeout):
        try:
            while not hs.done:
                out = hs.receive(recv_exact(sock, hs.bytes_needed(), deadline))
                if out:
                    if opened is not None:
                        opened()
                        opened = None
                    sock.sendall(out)
                if hs.error is not None:
                    raise hs.error
        except TimeoutError:
            raise ProtocolError(
                f"{_peer(sock)} sent no complete handshake within {timeout:g}s; it is not a "
                f"chorus client or it is stuck"
            ) from None
        except ConnectionError as e:
            if hs.awaiting_proof:
                raise AuthenticationError(
                    f"{_peer(sock)} closed the connection instead of proving the job token "
                    f"(its token probably differs); {TOKEN_ADVICE}"
                ) from e
            raise ProtocolError(
                f"{_peer(sock)} closed the {_label(purpose)} during the handshake ({e})"
            ) from e
    if not hs.authenticated:
        warn_unauthenticated_once(_label(purpose))


#: A connection that has not sent its opening handshake message this long after it was
#: accepted may be shed to admit a newer one (a rank sends its own at once).
SHED_AFTER_S = 0.25


def pending_limit() -> int:
    """How many incoming connections a server handshakes at once: CHORUS_MAX_PENDING_CONNECTIONS,
    and at most an eighth of this process's open-file limit (a rank has a transport and
    often a store server; each must leave descriptors for the job's own files and sockets)."""
    limit = config.get("CHORUS_MAX_PENDING_CONNECTIONS")
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return limit
    return limit if soft == resource.RLIM_INFINITY else max(4, min(limit, soft // 8))


class Pending:
    """The incoming connections a server is handshaking, oldest first: at most ``limit``
    (``pending_limit()``).  A server with no room sheds the oldest that has
    not sent its opening message for SHED_AFTER_S (a flood's idle connection, or a
    slow-loris), else waits for room: a flood then costs ``limit`` descriptors and drains
    at ``limit / SHED_AFTER_S`` connections a second, and a rank's connection, which
    opens at once, is never shed.  Thread-safe; the keys are the server's (sockets, ...)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.shed = 0  # connections shed so far
        self._since: dict[object, float] = {}  # key -> when accepted, oldest first
        self._opened: set[object] = set()
        self._shed: set[object] = set()  # shed, until removed
        self._cv = threading.Condition()

    def add(self, key: object) -> None:
        with self._cv:
            self._since[key] = time.monotonic()

    def __len__(self) -> int:
        """Connections being handshaken now."""
        with self._cv:
            return len(self._since)

    def opened(self, key: object) -> None:
        """``key`` sent its opening message: it is never shed."""
        with self._cv:
            if key in self._since:
                self._opened.add(key)

    def remove(self, key: object) -> None:
        """``key`` finished its handshake, or failed it."""
        with self._cv:
            self._since.pop(key, None)
            self._opened.discard(key)
            self._shed.discard(key)
            self._cv.notify_all()

    def was_shed(self, key: object) -> bool:
        return key in self._shed

    def room(self) -> tuple[bool, object | None, float]:
        """(True, None, 0) while there is room; (True, victim, 0) when ``victim``, removed
        here, must be shed to make room; else (False, None, seconds until one may be)."""
        with self._cv:
            if len(self._since) < self.limit:
                return True, None, 0.0
            now = time.monotonic()
            for key, since in self._since.items():
                if key not in self._opened:
                    if now - since < SHED_AFTER_S:
                        return False, None, SHED_AFTER_S - (now - since)
                    del self._since[key]
                    self._shed.add(key)
                    self.shed += 1
                    return True, key, 0.0
            return False, None, SHED_AFTER_S

    def wait(self, seconds: float) -> None:
        """Wait up to ``seconds`` or until a connection leaves."""
        with self._cv:
            self._cv.wait(seconds)
