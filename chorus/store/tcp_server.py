"""``TCPStoreServer``: the store server, one ``selectors`` event loop in a daemon thread.

Theory of operation: the loop owns every socket and the data.  A new connection first
runs the handshake (``chorus.wire.handshake.ServerHandshake``, fed from the loop, with
a deadline), then its bytes go through a ``RequestParser`` and its requests are
answered in order.  A ``get``/``wait``/``multi_get`` whose keys are missing is *parked*:
it is listed under each missing key and in a deadline heap, and is answered when the
last key is written or when its deadline passes - no polling, no thread per client.
A connection that fails the handshake or sends a malformed frame is logged and closed;
everyone else is unaffected.

Limits.  A client that did not prove the job token (every client of a tokenless job) may
send values of at most ``CHORUS_STORE_MAX_VALUE_BYTES`` (a longer request is dropped as it
arrives, never buffered) and may not grow the store beyond ``CHORUS_STORE_MAX_BYTES`` of
keys and values; either gets an ERROR answer naming the limit, and the connection goes on.
At most ``CHORUS_MAX_PENDING_CONNECTIONS`` connections handshake at once, each within
``CHORUS_HANDSHAKE_TIMEOUT``: with no room, the oldest that has not sent its opening
message within a quarter of a second is shed for the newcomer, else accepting waits
(``chorus.net.Pending``), so a flood neither exhausts the process's descriptors nor
keeps a rank's connection, which opens at once, waiting long.  Out of descriptors
(EMFILE), the loop stops accepting for a moment instead of spinning.
A failed handshake is also written into the store, under
REFUSED_KEY (why, the last one) and REFUSALS_KEY (how many): ranks waiting at rendezvous
for a rank that will never join - one started with another token - read them there.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import selectors
import socket
import threading
import time

from chorus import config
from chorus.errors import AuthenticationError, InvalidArgumentError, ProtocolError
from chorus.net import (
    SHED_AFTER_S,
    Pending,
    get_token,
    listen,
    pending_limit,
    warn_unauthenticated_once,
)
from chorus.store.base import add_to, compare_set_result
from chorus.wire.handshake import TOKEN_ADVICE, ServerHandshake
from chorus.wire.store_codec import (
    MAX_FRAME,
    Op,
    Refused,
    Request,
    RequestParser,
    Response,
    Status,
    pack_response,
)

logger = logging.getLogger("chorus")

_RECV_SIZE = 1 << 18

#: Keys where the server notes the connections it refused at the handshake.
REFUSED_KEY = "chorus/store/refused"
REFUSALS_KEY = "chorus/store/refusals"
_MAX_SLEEP = 3600.0  # the loop re-reads its deadlines at least this often
_KEY_SLACK = 64 * 1024  # request bytes beyond the largest value an unproven client may send
_ACCEPT_PAUSE_S = 0.1  # out of descriptors: how long the loop stops accepting
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class _Conn:
    """One client connection and its protocol state."""

    def __init__(self, sock: socket.socket, peer: str, handshake: ServerHandshake,
                 max_frame: int):
        self.sock = sock
        self.peer = peer
        self.handshake = handshake
        self.parser = RequestParser(max_frame)
        self.out = bytearray()
        self.queue: collections.deque[Request] = collections.deque()
        self.parked: _Parked | None = None
        self.closed = False
        self.limited = False  # joined without proving the job token: the limits apply


class _Resume:
    """A deadline-heap entry: accept connections again (after running out of descriptors)."""


class _Parked:
    """A blocking request waiting for ``missing`` keys until ``deadline``."""

    def __init__(self, conn: _Conn, request: Request, missing: set[bytes], deadline: float):
        self.conn = conn
        self.request = request
        self.missing = missing
        self.deadline = deadline
        self.active = True


def _ok(args: tuple[bytes, ...] = (), number: int = 0) -> Response:
    return Response(Status.OK, args, number)


class TCPStoreServer:
    """Serve a store on ``host:port`` (port 0: a free one, see ``.port``) until ``close()``.

    ``token`` (else $CHORUS_TOKEN) is required from every client when set.  Binds to
    ``host`` only ("" or "0.0.0.0": every interface).  Raises RendezvousError when the
    address is in use.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 token: bytes | str | None = None, *, handshake_timeout: float | None = None,
                 max_frame: int = MAX_FRAME):
        self._token = get_token(token)
        self._handshake_timeout = handshake_timeout or config.get("CHORUS_HANDSHAKE_TIMEOUT")
        self._pending = Pending(pending_limit())
        self._max_frame = max_frame
        self._max_value = config.get("CHORUS_STORE_MAX_VALUE_BYTES")
        self._max_bytes = config.get("CHORUS_STORE_MAX_BYTES")
        self._bytes = 0  # keys and values held
        self._starved = False  # accepting is paused (out of descriptors)
        self._listener = listen(host, port)
        self._listener.setblocking(False)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, self._accept)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._drain_wake)
        self._data: dict[bytes, bytes] = {}
        self._waiters: dict[bytes, list[_Parked]] = {}
        self._deadlines: list[tuple[float, int, object]] = []
        self._active_deadlines = 0
        self._seq = itertools.count()
        self._ready: collections.deque[_Conn] = collections.deque()
        self._conns: set[_Conn] = set()
        self._joined = 0
        self._joined_cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"chorus-store-server:{self.port}")
        self._thread.start()

    # -- lifecycle -------------------------------------------------------------------

    def wait_for_clients(self, count: int, timeout: float) -> int:
        """Block until ``count`` clients have completed the handshake or ``timeout``
        seconds pass; return how many have (connections are counted once, when they join).
        """
        deadline = time.monotonic() + timeout
        with self._joined_cond:
            while self._joined < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._joined_cond.wait(remaining)
            return self._joined

    def close(self) -> None:
        """Stop the loop and close the listening socket and every connection; idempotent."""
        if not self._closing:
            self._closing = True
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._wake_w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        try:
            while not self._closing:
                for key, mask in self._sel.select(self._next_timeout()):
                    key.data(mask)
                self._expire(time.monotonic())
                while self._ready:
                    self._serve_queue(self._ready.popleft())
        except Exception:
            logger.exception("chorus store server on %s:%s stopped on an internal error",
                             self.host, self.port)
        finally:
            for conn in list(self._conns):
                self._drop(conn)
            self._sel.close()
            self._listener.close()
            self._wake_r.close()

    def _drain_wake(self, mask: int) -> None:
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass

    # -- connections -----------------------------------------------------------------

    def _accept(self, mask: int) -> None:
        for _ in range(64):
            room, victim, wait = self._pending.room()
            if victim is not None:
                if self._pending.shed == 1:
                    logger.warning("chorus store server on %s:%s: %d connections are handshaking and more "
                                   "arrive: shedding the oldest that sent nothing within %g s (a flood of "
                                   "connections?)", self.host, self.port, self._pending.limit, SHED_AFTER_S)
                self._drop(victim)
            elif not room:
                self._sel.unregister(self._listener)  # until one may be shed (or leaves)
                self._push_deadline(time.monotonic() + wait, _Resume())
                return
            try:
                sock, addr = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in _OUT_OF_DESCRIPTORS:
                    self._pause_accepting(e)
                else:
                    logger.warning("chorus store server: accept failed: %s", e)
                return
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            conn = _Conn(sock, peer, ServerHandshake(self._token, b"store"), self._max_frame)
            self._conns.add(conn)
            self._pending.add(conn)
            self._sel.register(sock, selectors.EVENT_READ, lambda m, c=conn: self._on_event(c, m))
            self._push_deadline(time.monotonic() + self._handshake_timeout, conn)

    def _pause_accepting(self, error: OSError) -> None:
        """Out of descriptors: the listener stays readable, so stop watching it for a
        moment (else the loop spins); log the first time only."""
        if not self._starved:
            logger.warning("chorus store server on %s:%s: out of file descriptors (%s); pausing "
                           "accepts and retrying (a flood of connections, or raise `ulimit -n`)",
                           self.host, self.port, error)
            self._starved = True
        self._sel.unregister(self._listener)
        self._push_deadline(time.monotonic() + _ACCEPT_PAUSE_S, _Resume())

    def _on_event(self, conn: _Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(conn)
            if mask & selectors.EVENT_READ and not conn.closed:
                self._on_readable(conn)
        except (ProtocolError, AuthenticationError) as e:
            logger.warning("chorus store server: closing the connection from %s: %s",
                           conn.peer, e)
            if not conn.handshake.done or isinstance(e, AuthenticationError):
                self._note_refusal(f"a connection from {conn.peer}: "
                                   + str(e).replace(f"; {TOKEN_ADVICE}", ""))
            self._drop(conn)
        except OSError as e:
            logger.debug("chorus store server: connection from %s failed: %s", conn.peer, e)
            self._drop(conn)
        except Exception:  # a bug must cost one connection, not the whole job's store
            logger.exception("chorus store server: internal error serving %s; closing it",
                             conn.peer)
            self._drop(conn)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            if conn.handshake.awaiting_proof:
                raise AuthenticationError(
                    f"the client closed the connection instead of proving the job token (its "
                    f"token probably differs); {TOKEN_ADVICE}"
                )
            self._drop(conn)
            return
        hs = conn.handshake
        if not hs.done:
            reply = hs.receive(data)
            if reply:
                self._pending.opened(conn)
                self._send(conn, reply)
            if hs.error is not None:
                raise hs.error
            if not hs.done:
                return
            self._pending.remove(conn)
            self._on_joined(hs)
            if not hs.authenticated:
                conn.limited = True
                conn.parser.refuse_over = self._max_value + _KEY_SLACK
            data = hs.leftover
        if data:
            conn.queue.extend(conn.parser.feed(data))
            self._serve_queue(conn)

    def _on_joined(self, hs: ServerHandshake) -> None:
        if not hs.authenticated:
            warn_unauthenticated_once("store connection")
        with self._joined_cond:
            self._joined += 1
            self._joined_cond.notify_all()

    def _note_refusal(self, why: str) -> None:
        count = int(self._data.get(REFUSALS_KEY.encode(), b"0")) + 1
        self._write(REFUSED_KEY.encode(), why.encode())
        self._write(REFUSALS_KEY.encode(), str(count).encode())

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.closed:
            return
        if not conn.out:
            try:
                sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:  # this client is gone; whoever triggered the send is not
                logger.debug("chorus store server: sending to %s failed: %s", conn.peer, e)
                self._drop(conn)
                return
            if sent == len(data):
                return
            data = data[sent:]
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE,
                             self._sel.get_key(conn.sock).data)
        conn.out += data

    def _flush(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        del conn.out[:sent]
        if not conn.out:
            self._sel.modify(conn.sock, selectors.EVENT_READ, self._sel.get_key(conn.sock).data)

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        self._pending.remove(conn)
        if conn.parked is not None:
            self._unpark(conn.parked)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # -- deadlines -------------------------------------------------------------------

    def _push_deadline(self, deadline: float, item: object) -> None:
        heapq.heappush(self._deadlines, (deadline, next(self._seq), item))
        self._active_deadlines += 1

    def _next_timeout(self) -> float | None:
        if not self._deadlines:
            return None
        return min(max(0.0, self._deadlines[0][0] - time.monotonic()), _MAX_SLEEP)

    def _expire(self, now: float) -> None:
        """Answer parked requests and drop silent handshakes whose deadline has passed."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, item = heapq.heappop(self._deadlines)
            if isinstance(item, _Parked):
                if item.active:
                    self._time_out(item)
            elif isinstance(item, _Resume):
                self._active_deadlines -= 1
                if not self._closing:
                    self._sel.register(self._listener, selectors.EVENT_READ, self._accept)
            else:
                self._active_deadlines -= 1
                if not item.closed and not item.handshake.done:
                    logger.warning("chorus store server: closing the connection from %s: no "
                                   "handshake within %gs", item.peer, self._handshake_timeout)
                    self._drop(item)
        if len(self._deadlines) > 1024 + 2 * self._active_deadlines:
            self._deadlines = [e for e in self._deadlines
                               if not isinstance(e[2], _Parked) or e[2].active]
            heapq.heapify(self._deadlines)

    # -- requests --------------------------------------------------------------------

    def _serve_queue(self, conn: _Conn) -> None:
        """Answer ``conn``'s queued requests in order until one parks."""
        while conn.queue and conn.parked is None and not conn.closed:
            request = conn.queue.popleft()
            response = self._handle(conn, request)
            if response is not None:
                self._send(conn, pack_response(response))

    def _handle(self, conn: _Conn, request: Request | Refused) -> Response | None:
        if isinstance(request, Refused):
            return self._refusal(f"a request of {request.length} bytes: such clients may send requests of "
                                 f"at most {self._max_value + _KEY_SLACK} bytes (CHORUS_STORE_MAX_VALUE_BYTES "
                                 "plus 64 KiB for keys)")
        op, args = request.op, request.args
        if op in (Op.GET, Op.WAIT, Op.MULTI_GET):
            return self._blocking(conn, request)
        if conn.limited and op in (Op.SET, Op.MULTI_SET, Op.COMPARE_SET, Op.ADD):
            refused = self._over_limits(request)
            if refused is not None:
                return refused
        if op is Op.SET:
            self._write(args[0], args[1])
            return _ok()
        if op is Op.MULTI_SET:
            for i in range(0, len(args), 2):
                self._write(args[i], args[i + 1])
            return _ok()
        if op is Op.ADD:
            key = args[0]
            try:
                value = add_to(self._data.get(key), request.number, key.decode(errors="replace"))
            except InvalidArgumentError as e:
                return Response(Status.ERROR, (str(e).encode(),))
            self._write(key, value)
            return _ok(number=int(value))
        if op is Op.COMPARE_SET:
            new, result = compare_set_result(self._data.get(args[0]), args[1], args[2])
            if new is not None:
                self._write(args[0], new)
            return _ok((result,))
        if op is Op.CHECK:
            return _ok(number=int(all(k in self._data for k in args)))
        if op is Op.DELETE_KEY:
            old = self._data.pop(args[0], None)
            if old is not None:
                self._bytes -= len(args[0]) + len(old)
            return _ok(number=int(old is not None))
        return _ok(number=len(self._data))  # Op.NUM_KEYS

    def _over_limits(self, request: Request) -> Response | None:
        """The ERROR answer to a write of a client without the token that breaks a limit."""
        args = request.args
        writes = (dict(zip(args[::2], args[1::2], strict=True)) if request.op is Op.MULTI_SET
                  else {args[0]: args[2]} if request.op is Op.COMPARE_SET
                  else {args[0]: b"0" * 20} if request.op is Op.ADD  # a counter: 20 digits at most
                  else {args[0]: args[1]})
        longest = max((len(value) for value in writes.values()), default=0)
        if longest > self._max_value:
            return self._refusal(f"a value of {longest} bytes: such clients may send values of at most "
                                 f"{self._max_value} bytes (CHORUS_STORE_MAX_VALUE_BYTES)")
        growth = sum(len(value) - (len(self._data[key]) if key in self._data else -len(key))
                     for key, value in writes.items())
        if growth > 0 and self._bytes + growth > self._max_bytes:
            return self._refusal(f"to grow from {self._bytes} to {self._bytes + growth} bytes: such clients "
                                 f"may not grow it beyond {self._max_bytes} bytes (CHORUS_STORE_MAX_BYTES)")
        return None

    @staticmethod
    def _refusal(what: str) -> Response:
        message = (f"the store refused {what}, since this client did not prove the job token. Give every "
                   "rank and the launcher the same CHORUS_TOKEN (chorusrun and spawn make one), or raise "
                   "the limit where the store is hosted")
        return Response(Status.ERROR, (message.encode(),))

    def _blocking(self, conn: _Conn, request: Request) -> Response | None:
        """Answer a GET/WAIT/MULTI_GET now, or park it until its keys or its deadline."""
        missing = {k for k in request.args if k not in self._data}
        if not missing:
            return self._found(request)
        if request.number == 0:
            return self._timeout_response(request, missing)
        parked = _Parked(conn, request, missing, time.monotonic() + request.number / 1000)
        for key in missing:
            self._waiters.setdefault(key, []).append(parked)
        conn.parked = parked
        self._push_deadline(parked.deadline, parked)
        return None

    def _found(self, request: Request) -> Response:
        """The answer to a blocking request whose keys all exist."""
        if request.op is Op.WAIT:
            return _ok()
        return _ok(tuple(self._data[k] for k in request.args))

    @staticmethod
    def _timeout_response(request: Request, missing: set[bytes]) -> Response:
        keys = tuple(k for k in dict.fromkeys(request.args) if k in missing)
        return Response(Status.TIMEOUT, keys, request.number)

    def _write(self, key: bytes, value: bytes) -> None:
        """Store ``key`` and answer the parked requests that were waiting only for it."""
        old = self._data.get(key)
        self._bytes += len(value) - (len(old) if old is not None else -len(key))
        self._data[key] = value
        for parked in self._waiters.pop(key, ()):
            if parked.active:
                parked.missing.discard(key)
                if not parked.missing:
                    self._answer(parked)

    def _answer(self, parked: _Parked) -> None:
        """Answer a parked request whose keys all arrived (re-park if one was deleted)."""
        request = parked.request
        missing = {k for k in request.args if k not in self._data}
        if missing:
            parked.missing = missing
            for key in missing:
                self._waiters.setdefault(key, []).append(parked)
            return
        self._unpark(parked)
        self._send(parked.conn, pack_response(self._found(request)))
        self._ready.append(parked.conn)

    def _unpark(self, parked: _Parked) -> None:
        """Forget a parked request (it was answered, timed out, or its client left)."""
        parked.active = False
        self._active_deadlines -= 1
        parked.conn.parked = None
        for key in parked.missing:
            waiting = self._waiters.get(key)
            if waiting is not None:
                waiting[:] = [p for p in waiting if p is not parked]
                if not waiting:
                    del self._waiters[key]

    def _time_out(self, parked: _Parked) -> None:
        self._unpark(parked)
        self._send(parked.conn, pack_response(self._timeout_response(parked.request,
                                                                     parked.missing)))
        self._ready.append(parked.conn)
