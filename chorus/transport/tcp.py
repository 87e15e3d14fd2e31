"""TCP transport: one authenticated connection per pair of ranks (full mesh).

Theory of operation
-------------------
Set-up: every rank listens on a free port of its host and publishes ``host:port`` in
the store; rank ``i`` connects to every rank ``j < i`` and accepts from every ``j > i``.
Each connection runs the token handshake (``chorus.net``) and then a HELLO frame naming
the rank, so a stranger can neither read nor inject data; ``tcp_accept`` bounds what
strangers cost (a total handshake deadline, a cap on connections being admitted, and an
accept loop that outlives running out of descriptors).

Receiving (``tcp_receive``): a thread about to wait for a small message reads the peer's
socket itself, so the message wakes that thread alone; otherwise each connection's reader
thread reads, and it parks while rank threads read.  Either way a frame's payload goes
straight into its posted receive, or is stashed until one is posted; a frame that must be
stashed or skipped may claim at most ``max_message_bytes()`` (else the peer is cut off).

Sending: a caller that will wait at once (``sync``), or any small message, is written by
the calling thread — no thread hand-off; one whose caller waits for nothing else
(``send_now``) makes no handle unless it must be handed over or fails.  Large
asynchronous sends go to a per-peer sender thread so the caller can post its receives
meanwhile.  Sends to one peer leave in the order they were posted (a frame is written
by its caller only while none is queued).  Writes go in bounded slices (``tcp_writer``):
a caller whose peer takes nothing for a slice hands the rest of its frame to the sender
thread and goes back to wait with its op's deadline; the sender thread stops as soon as
the peer is lost.

Same host: two ranks that share a host (and /dev/shm) also share a pair of byte rings,
set up right after the HELLO (``shm_link``).  Payloads of 256 KiB and more then go
through the ring while their headers still go over the socket — matching, order,
fingerprints, BYE and failure detection are unchanged; only where the bytes travel
differs.  ``CHORUS_SHM_P2P=0`` or ``CHORUS_TRANSPORT=tcp`` keep everything on the socket.

Failures: EOF or a reset on a connection whose peer did not say BYE means that peer
died; this rank fails everything pending in that peer's groups and sends PEER_LOST to
every other rank, which do the same — so all survivors fail within milliseconds of the
kernel noticing.  A heartbeat every second on idle connections catches hung hosts; a
payload still arriving counts as a sign of life, one that stalls mid-way does not.  A
lost peer's socket is shut down, which wakes any thread blocked on it, and a reader that
fails on anything unforeseen cuts its peer off the same way (never silently).
A rank that fails by raising says so first (FAILED, with its error, passed on like
PEER_LOST), so the survivors' errors name the cause; it leaves its connections open until
its process exits, whose EOF then tells the peers it has (``wait_exited``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from chorus import config, net
from chorus.errors import RendezvousError
from chorus.host import cpus
from chorus.transport import shm_link
from chorus.transport.base import Transport
from chorus.transport.handles import Handle
from chorus.transport.ring import RingReader, RingWriter
from chorus.transport.tcp_accept import Doorway
from chorus.transport.tcp_reader import BELL, BufferedReader
from chorus.transport.tcp_receive import ReadRole, TcpReceiving
from chorus.transport.tcp_writer import SEND_SLICE_S, bound_sends, send_rest, send_some
from chorus.wire.frames import MAX_PAYLOAD, Kind, LostReason, control_header, pack_fields

log = logging.getLogger("chorus")

INLINE_MAX = 256 * 1024  # async sends up to this size are written by the caller
COALESCE_MAX = 64 * 1024  # header and payload go out in one syscall up to this size
HEARTBEAT_S = 1.0
_EMPTY = memoryview(b"")


def heartbeat_timeout() -> float:
    """Seconds of silence after which a peer is lost (``CHORUS_HEARTBEAT_TIMEOUT``)."""
    return config.get("CHORUS_HEARTBEAT_TIMEOUT")


def max_message_bytes() -> int:
    """The most bytes a frame may claim when it must be buffered or skipped
    (``CHORUS_MAX_MESSAGE_BYTES``; unset: this host's physical memory)."""
    limit = config.get("CHORUS_MAX_MESSAGE_BYTES")
    if limit is None:
        try:
            limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            limit = MAX_PAYLOAD
    return limit


def local_address_towards(remote: str | None) -> str:
    """The address of this host that ``remote`` can reach (``CHORUS_SOCKET_HOST`` wins)."""
    override = config.get("CHORUS_SOCKET_HOST")
    if override:
        return override
    if not remote or remote == "localhost":
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(socket.gethostbyname(remote)).is_loopback:
            return "127.0.0.1"
    except (OSError, ValueError):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((remote, 9))  # UDP: no packet is sent
        return probe.getsockname()[0]


SPIN_US = 200.0  # W=8, 4 B: median 70-82 us polling 50-1000 us, 91-94 not (docs/results/16-vcpu-xeon/tcp-exchange)


def spin_seconds(world_size: int) -> float:
    """How long a rank thread waiting for a small message polls the socket before it sleeps
    (``CHORUS_TCP_SPIN_US``; by default SPIN_US where the host's ranks do not outnumber the
    CPUs, since a poller takes the CPU from the rank it waits for, else none).  A sleeper
    costs a wake-up per message, several microseconds on a quiet host."""
    spin = config.get("CHORUS_TCP_SPIN_US")
    if spin is None:
        spin = SPIN_US if cpus.ranks_here(world_size) <= cpus.usable() else 0.0
    return spin * 1e-6


class _Connection:
    __slots__ = ("peer", "sock", "gone", "cv", "queue", "sender", "last_sent", "last_heard", "reading",
                 "seen", "bye", "ended", "broken", "reader", "role", "ring_out", "ring_in", "ring_min", "own")

    def __init__(self, peer: int, sock: socket.socket, gone: Callable[[], str | None]):
        self.peer = peer
        self.sock = sock
        self.gone = gone  # why writes to the peer must stop (lost, or this rank closed), else None
        self.cv = threading.Condition()
        # Frames waiting for the sender thread: (header bytes still to send, payload, payload
        # bytes already sent, handle).  The first one is being written while it is listed.
        self.queue: deque[tuple[bytes, memoryview, int, Handle | None]] = deque()
        self.sender: threading.Thread | None = None
        self.last_sent = self.last_heard = time.monotonic()
        self.reading = False  # a payload is being read: progress, not frames, shows life
        self.seen = -1  # bytes received by the time the heartbeat loop last looked
        self.bye = False
        self.ended = threading.Event()  # set when the peer closed the connection (or it broke)
        self.broken = False  # reading failed: nobody reads the connection again
        self.reader = BufferedReader(sock)
        self.role = ReadRole()  # which thread reads the connection (tcp_receive)
        # Same-host peers: payloads of >= ring_min bytes go through shared memory (shm_link)
        self.ring_out: RingWriter | None = None
        self.ring_in: RingReader | None = None
        self.ring_min = MAX_PAYLOAD + 1
        # A receive from the peer that the thread holding ``role`` reads for without posting
        # it with the matcher (TcpReceiving.recv_now): the next frame of its key is its own.
        self.own: Handle | None = None


class TcpTransport(TcpReceiving, Transport):
    name = "tcp"

    def __init__(self, rank: int, world_size: int, store, *, token: bytes | None,
                 timeout: float, host: str | None = None, rings: bool = True):
        super().__init__(rank, world_size)
        self._token = token
        self._rings = rings  # shared-memory rings with peers on this host (chorus.transport.shm_link)
        self.authenticated = token is not None  # every connection proves it (net.*_handshake)
        self._conns: dict[int, _Connection] = {}
        self._conns_cv = threading.Condition()
        self._timeout = timeout
        self._max_message = max_message_bytes()
        self._closing = threading.Event()  # set by close(): writes stop
        self.spin_s = spin_seconds(world_size)
        host = host or "127.0.0.1"
        self.listen_host = host  # (where the other ranks reach this one: a store served here goes there too)
        listener = net.listen(host, 0)
        port = listener.getsockname()[1]
        if rank == 0:
            store.set("tcp/session", str(secrets.randbits(62)))
        self._session = int(store.get("tcp/session"))
        store.set(f"tcp/addr/{rank}", f"{host}:{port}")
        self._doorway = Doorway(listener, rank=rank, world_size=world_size, token=token, session=self._session,
                                connected=self._conns.__contains__, register=self._register, rings=rings)
        self._doorway.start()
        deadline = time.monotonic() + timeout
        # Fetch every address before connecting: rank 0's set-up (and so the store it
        # may host) then cannot finish while another rank still reads from the store.
        addrs = store.multi_get([f"tcp/addr/{peer}" for peer in range(rank)]) if rank else []
        for peer, addr in enumerate(addrs):
            self._connect(peer, addr.decode(), deadline)
        self._wait_for_mesh(deadline)
        threading.Thread(target=self._heartbeat_loop, name=f"chorus-heartbeat-r{rank}", daemon=True).start()

    def sibling(self, rank: int, world_size: int, store, timeout: float) -> TcpTransport:
        """Another transport, among ``world_size`` ranks met through ``store`` (this rank is
        ``rank`` there), with this one's token and address and no shared-memory rings: the
        job's channels (chorus.components.channels).  Every one of those ranks calls it."""
        return TcpTransport(rank, world_size, store, token=self._token, timeout=timeout, host=self.listen_host,
                            rings=False)

    # -- set-up ----------------------------------------------------------------------------
    def _connect(self, peer: int, addr: str, deadline: float) -> None:
        host, _, port = addr.rpartition(":")
        sock = net.connect_and_handshake(host, int(port), self._token, b"transport",
                                         max(1.0, deadline - time.monotonic()))
        sock.sendall(control_header(Kind.HELLO, tag=self.rank, group=self.world_size)
                     + self._session.to_bytes(8, "little"))
        sock.settimeout(max(1.0, deadline - time.monotonic()))
        try:
            pairing = shm_link.connector_side(sock, self.rank, self.world_size, self._rings)
        except (OSError, ConnectionError) as exc:
            sock.close()
            raise RendezvousError(
                f"rank {self.rank}: rank {peer} at {addr} dropped the transport connection during "
                f"set-up ({exc}). Is it a rank of this job, started with the same store?") from None
        self._register(peer, sock, pairing)

    def _register(self, peer: int, sock: socket.socket, pairing: shm_link.Pairing | None) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        bound_sends(sock)
        conn = _Connection(peer, sock, self._gone_for(peer))
        if pairing is not None:
            dead, left = self.dead, self.left  # not self: no reference cycle through the rings

            def gone() -> str | None:
                return dead.get(peer) or ("left the job (destroy_process_group)" if peer in left else None)

            conn.ring_out, conn.ring_in = shm_link.ring_ends(
                pairing, peer=peer, bell=lambda: send_some(sock, BELL, None, gone), doze=conn.reader.doze,
                gone=gone)
            conn.ring_min = pairing.min_bytes
        with self._conns_cv:
            self._conns[peer] = conn
            self._conns_cv.notify_all()
        threading.Thread(target=self._read_loop, args=(conn,), name=f"chorus-rx-r{self.rank}-from{peer}",
                         daemon=True).start()

    def _wait_for_mesh(self, deadline: float) -> None:
        with self._conns_cv:
            ok = self._conns_cv.wait_for(lambda: len(self._conns) == self.world_size - 1,
                                         timeout=max(0.0, deadline - time.monotonic()))
            if not ok:
                missing = sorted(set(range(self.world_size)) - set(self._conns) - {self.rank})
                raise RendezvousError(
                    f"rank {self.rank}: no transport connection from ranks {missing} after "
                    f"{self._timeout:.0f} s. Are they running, and can they reach this host?"
                )

    # -- sending -------------------------------------------------------------------------
    def _send_frame(self, peer: int, header: bytes, view: memoryview, handle: Handle, sync: bool) -> None:
        conn = self._conns.get(peer)
        if conn is None:
            raise ValueError(f"rank {self.rank} has no connection to rank {peer}")
        if self._send_inline(conn, header, view, sync, handle) is None:
            handle.complete()

    def send_now(self, peer: int, view: memoryview, kind: int, group: int, tag: int, seq: int, dtype: int,
                 fingerprint: int) -> Handle | None:
        """``Transport.send_now``: a frame written whole by this thread needs no handle."""
        conn = self._conns.get(peer)
        if conn is None or self.failure(group, peer, expect=(seq, fingerprint) if fingerprint else None):
            return self.isend(peer, view, kind=kind, group=group, tag=tag, seq=seq, dtype=dtype,
                              fingerprint=fingerprint, sync=True)
        return self._send_inline(conn, pack_fields(kind, group, tag, seq, len(view), dtype, fingerprint), view,
                                 True, None, (kind, group, tag, dtype))

    def _send_inline(self, conn: _Connection, header: bytes, view: memoryview, sync: bool, handle: Handle | None,
                     key: tuple[int, int, int, int] | None = None) -> Handle | None:
        """Write a frame in this thread when nothing is queued ahead of it (and it is
        ``sync`` or small): None once all of it is out.  Otherwise its handle (``handle``,
        or one made here from ``key``, (kind, group, tag, dtype)), queued for the sender
        thread with the frame or what is left of it, or failed."""
        cv = conn.cv
        cv.acquire()  # (not ``with``: a Condition's __enter__ and __exit__ are two more calls per send)
        try:
            if conn.queue or not (sync or len(view) <= INLINE_MAX):
                handle = handle or Handle(conn.peer, key[0], key[1], key[2], view, key[3])
                self._enqueue(conn, (header, view, 0, handle))
                return handle
            try:
                rest = self._write(conn, header, view, 0, patient=False)
            except OSError as exc:
                handle = handle or Handle(conn.peer, key[0], key[1], key[2], view, key[3])
                handle.complete(error=self._lost_error(conn.peer, f"died (send failed: {exc})", handle.group))
                self._lose(conn.peer, f"died (send failed: {exc})")
                return handle
            if rest is not None:
                # The peer took nothing for a whole slice: the sender thread writes the rest, so
                # this caller goes back to wait with its op's deadline.
                handle = handle or Handle(conn.peer, key[0], key[1], key[2], view, key[3])
                self._enqueue(conn, (*rest, handle))
                return handle
        finally:
            cv.release()
        return None

    def _enqueue(self, conn: _Connection, item: tuple[bytes, memoryview, int, Handle | None]) -> None:
        """Queue a frame for the peer's sender thread.  Caller holds ``conn.cv``."""
        conn.queue.append(item)
        if conn.sender is None:
            conn.sender = threading.Thread(target=self._send_loop, args=(conn,),
                                           name=f"chorus-tx-r{self.rank}-to{conn.peer}", daemon=True)
            conn.sender.start()
        conn.cv.notify()

    def _send_loop(self, conn: _Connection) -> None:
        """Write queued frames in order.  The frame being written stays first in the queue
        (so nobody else writes meanwhile) but ``conn.cv`` is free: failing, queueing and
        relaying never wait for a slow peer."""
        while True:
            with conn.cv:
                while not conn.queue:
                    if self.closed_reason is not None:
                        return
                    conn.cv.wait(1.0)
                header, view, done, handle = conn.queue[0]
            try:
                self._write(conn, header, view, done)
            except OSError as exc:
                with conn.cv:
                    failed = list(conn.queue)
                    conn.queue.clear()
                    conn.cv.notify_all()
                error = self._lost_error(conn.peer, f"died (send failed: {exc})", 0)
                for *_, h in failed:
                    if h is not None:
                        h.complete(error=error)
                if self.closed_reason is None:
                    self._lose(conn.peer, f"died (send failed: {exc})")
                return
            with conn.cv:
                conn.queue.popleft()
                if not conn.queue:
                    conn.cv.notify_all()  # close() may be waiting for the queue to drain
            if handle is not None:
                handle.complete()

    def _write(self, conn: _Connection, header: bytes, view: memoryview, done: int,
               patient: bool = True) -> tuple[bytes, memoryview, int] | None:
        """Write a frame: ``header`` (what is left of it), then ``view`` from byte ``done``.

        None once all of it is out.  Not ``patient``: after a slice in which the peer took
        nothing more, return what is left, (header, view, done), for the sender thread.
        Raises ConnectionError as soon as the peer is known lost (see tcp_writer).
        """
        n = len(view)
        if n >= conn.ring_min:
            return self._write_ring(conn, header, view, done, patient)
        until = None if patient else 0.0
        if header:
            if n <= COALESCE_MAX and not done:
                header, view, n = (header + view if n else header), _EMPTY, 0
            try:  # (send_some written out: a small frame is one send(), and this is its cost)
                sent = conn.sock.send(header)
            except BlockingIOError:  # a whole slice without room
                sent = 0
            if sent < len(header):
                sent = send_rest(conn.sock, header, sent, until, conn.gone)
                if sent < len(header):
                    return header[sent:], view, done
        if done < n:
            done += send_some(conn.sock, view[done:], until, conn.gone)
            if done < n:
                return b"", view, done
        conn.last_sent = time.monotonic()
        return None

    def _write_ring(self, conn: _Connection, header: bytes, view: memoryview, done: int,
                    patient: bool) -> tuple[bytes, memoryview, int] | None:
        """``_write`` for a payload that goes through the shared-memory ring."""
        def announce() -> None:
            if header:
                send_some(conn.sock, header, None, conn.gone)

        done = conn.ring_out.write(view, announce, done, None if patient else SEND_SLICE_S)
        if done < len(view):
            return (b"" if done else header), view, done
        conn.last_sent = time.monotonic()
        return None

    def _gone_for(self, peer: int) -> Callable[[], str | None]:
        """``gone()`` for writes to ``peer``: why it will read no more, or None."""
        dead, closing = self.dead, self._closing  # not self: no reference cycle through conns

        def gone() -> str | None:
            if closing.is_set():
                return "is unreachable: this rank's transport is closed"
            return dead.get(peer)
        return gone

    def _fail_sends(self, pred, error_for) -> None:
        for conn in list(self._conns.values()):
            with conn.cv:  # the first frame is being written: its writer completes it
                doomed = [item for item in list(conn.queue)[1:] if item[3] is not None and pred(item[3])]
                for item in doomed:
                    conn.queue.remove(item)
            for *_, h in doomed:
                h.complete(error=error_for(h))

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for conn in list(self._conns.values()):
            with conn.cv:
                conn.cv.wait_for(lambda c=conn: not c.queue, timeout=max(0.0, deadline - time.monotonic()))

    def wait_exited(self, rank: int, timeout: float) -> bool:
        conn = self._conns.get(rank)
        return conn is not None and conn.ended.wait(timeout)

    def shm_p2p_stats(self) -> dict[int, tuple[int, int]]:
        """Same-host peers with rings -> (payload bytes sent, received) through them."""
        return {peer: (c.ring_out.bytes, c.ring_in.bytes)
                for peer, c in list(self._conns.items()) if c.ring_out is not None}

    # -- failures ------------------------------------------------------------------------
    def _lose(self, peer: int, why: str, reason: int = LostReason.DIED) -> None:
        """``peer`` is gone: tell every other rank (with why), fail its groups here, and
        shut its socket down so that no thread stays blocked on it."""
        if self.peer_died(peer, why, reason):
            conn = self._conns.get(peer)
            if conn is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _notify(self, ranks: list[int], frame: bytes) -> None:
        for other in ranks:
            conn = self._conns.get(other)
            if conn is not None and other not in self.dead and not conn.bye:
                with conn.cv:
                    self._enqueue(conn, (frame, _EMPTY, 0, None))

    def _heartbeat_loop(self) -> None:
        """Every second: a heartbeat to each peer this rank has not written to lately, and
        the liveness check of each peer — silent for CHORUS_HEARTBEAT_TIMEOUT, counting a
        payload that still arrives (socket or ring) as heard."""
        beat = control_header(Kind.HEARTBEAT)
        limit = heartbeat_timeout()
        while self.closed_reason is None:
            time.sleep(HEARTBEAT_S)
            now = time.monotonic()
            for peer, conn in list(self._conns.items()):
                if peer in self.dead or conn.bye:
                    continue
                if now - conn.last_sent >= HEARTBEAT_S and conn.cv.acquire(blocking=False):
                    try:
                        if not conn.queue:
                            self._beat(conn, beat, now)
                    finally:
                        conn.cv.release()
                if conn.reading:
                    progress = conn.reader.received + (conn.ring_in.tail if conn.ring_in is not None else 0)
                    if progress != conn.seen:
                        conn.seen, conn.last_heard = progress, now
                silent = now - conn.last_heard
                if silent > limit:
                    self._lose(peer, f"stopped answering (no heartbeat for {silent:.0f} s)", LostReason.SILENT)

    def _beat(self, conn: _Connection, beat: bytes, now: float) -> None:
        """Send a heartbeat without waiting (caller holds ``conn.cv``; nothing is queued):
        a full socket needs none, and a partly sent one is finished by the sender thread."""
        try:
            sent = conn.sock.send(beat, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            return  # the reader notices the broken connection
        if sent < len(beat):
            self._enqueue(conn, (beat[sent:], _EMPTY, 0, None))
        conn.last_sent = now

    # -- shutdown ------------------------------------------------------------------------
    def close(self) -> None:
        """Flush queued sends (up to 5 s), say BYE to every peer, close every socket."""
        if self.closed_reason is not None:
            return
        self.flush(5.0)
        super().close()
        self._closing.set()
        bye = control_header(Kind.BYE)
        for conn in list(self._conns.values()):
            with conn.cv:
                if not conn.queue:  # else a frame is half-written: the peer sees EOF instead
                    try:
                        send_some(conn.sock, bye, 0.0, lambda: None)
                    except OSError:
                        pass
                conn.cv.notify_all()
        for conn in list(self._conns.values()):
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.sock.close()
        self._doorway.close()
