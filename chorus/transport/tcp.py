"""TCP transport: one authenticated connection per pair of ranks (full mesh).

Theory of operation
-------------------
Set-up: every rank listens on a free port of its host and publishes ``host:port`` in
the store; rank ``i`` connects to every rank ``j < i`` and accepts from every ``j > i``.
Each connection runs the token handshake (``chorus.net``) and then a HELLO frame naming
the rank, so a stranger can neither read nor inject data.

Receiving: one reader thread per connection blocks in ``recv`` (the GIL is released).
For each frame header it asks the matcher for the posted receive and reads the payload
straight into that buffer; if none is posted it stashes the payload (for large messages
it first waits a few milliseconds for the receive to be posted, which in a streaming
loop saves copying the whole payload once more).

Sending: a caller that will wait at once (``sync``), or any small message, is written by
the calling thread — no thread hand-off.  Large asynchronous sends go to a per-peer
sender thread so the caller can post its receives meanwhile.  Sends to one peer leave
in the order they were posted.

Same host: two ranks that share a host (and /dev/shm) also share a pair of byte rings,
set up right after the HELLO (``shm_link``).  Payloads of 256 KiB and more then go
through the ring while their headers still go over the socket — matching, order,
fingerprints, BYE and failure detection are unchanged; only where the bytes travel
differs.  ``CHORUS_SHM_P2P=0`` or ``CHORUS_TRANSPORT=tcp`` keep everything on the socket.

Failures: EOF or a reset on a connection whose peer did not say BYE means that peer
died; this rank fails everything pending in that peer's groups and sends PEER_LOST to
every other rank, which do the same — so all survivors fail within milliseconds of the
kernel noticing.  A heartbeat every second on idle connections catches hung hosts.  A
rank that fails by raising says so first (FAILED, with its error, passed on like
PEER_LOST), so the survivors' errors name the cause; it leaves its connections open until
its process exits, whose EOF then tells the peers it has (``wait_exited``).
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import socket
import threading
import time
from collections import deque

import numpy as np

from chorus import config, net
from chorus.errors import ProtocolError, RendezvousError
from chorus.transport import shm_link
from chorus.transport.base import Transport, control_header
from chorus.transport.handles import Handle
from chorus.transport.ring import RingReader, RingWriter
from chorus.transport.tcp_reader import BELL, BufferedReader
from chorus.wire.frames import (
    HEADER_SIZE,
    LOST_REASON_TEXT,
    MAX_PAYLOAD,
    Header,
    Kind,
    LostReason,
    failed_text,
    unpack_header,
)

log = logging.getLogger("chorus")

INLINE_MAX = 256 * 1024  # async sends up to this size are written by the caller
COALESCE_MAX = 64 * 1024  # header and payload go out in one syscall up to this size
POST_GRACE_S = 0.005  # how long a reader waits for a large message's receive to be posted
POST_GRACE_MIN = 256 * 1024
HEARTBEAT_S = 1.0
_EMPTY = memoryview(b"")


def heartbeat_timeout() -> float:
    """Seconds of silence after which a peer is lost (``CHORUS_HEARTBEAT_TIMEOUT``)."""
    return config.get("CHORUS_HEARTBEAT_TIMEOUT")


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


class _Connection:
    __slots__ = ("peer", "sock", "cv", "queue", "sender", "last_sent", "last_heard", "reading",
                 "bye", "ended", "reader", "ring_out", "ring_in", "ring_min")

    def __init__(self, peer: int, sock: socket.socket):
        self.peer = peer
        self.sock = sock
        self.cv = threading.Condition()
        self.queue: deque[tuple[bytes, memoryview, Handle | None]] = deque()
        self.sender: threading.Thread | None = None
        self.last_sent = self.last_heard = time.monotonic()
        self.reading = False
        self.bye = False
        self.ended = threading.Event()  # set when the peer closed the connection (or it broke)
        self.reader = BufferedReader(sock)
        # Same-host peers: payloads of >= ring_min bytes go through shared memory (shm_link)
        self.ring_out: RingWriter | None = None
        self.ring_in: RingReader | None = None
        self.ring_min = MAX_PAYLOAD + 1


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, rank: int, world_size: int, store, *, token: bytes | None,
                 timeout: float, host: str | None = None):
        super().__init__(rank, world_size)
        self._token = token
        self._conns: dict[int, _Connection] = {}
        self._conns_cv = threading.Condition()
        self._timeout = timeout
        host = host or "127.0.0.1"
        self._listener = net.listen(host, 0)
        port = self._listener.getsockname()[1]
        if rank == 0:
            store.set("tcp/session", str(secrets.randbits(62)))
        self._session = int(store.get("tcp/session"))
        store.set(f"tcp/addr/{rank}", f"{host}:{port}")
        threading.Thread(target=self._accept_loop, name=f"chorus-accept-r{rank}", daemon=True).start()
        deadline = time.monotonic() + timeout
        # Fetch every address before connecting: rank 0's set-up (and so the store it
        # may host) then cannot finish while another rank still reads from the store.
        addrs = store.multi_get([f"tcp/addr/{peer}" for peer in range(rank)]) if rank else []
        for peer, addr in enumerate(addrs):
            self._connect(peer, addr.decode(), deadline)
        self._wait_for_mesh(deadline)
        threading.Thread(target=self._heartbeat_loop, name=f"chorus-heartbeat-r{rank}", daemon=True).start()

    # -- set-up ----------------------------------------------------------------------------
    def _connect(self, peer: int, addr: str, deadline: float) -> None:
        host, _, port = addr.rpartition(":")
        sock = net.connect(host, int(port), max(0.1, deadline - time.monotonic()))
        net.client_handshake(sock, self._token, b"transport", max(1.0, deadline - time.monotonic()))
        sock.sendall(control_header(Kind.HELLO, tag=self.rank, group=self.world_size)
                     + self._session.to_bytes(8, "little"))
        sock.settimeout(max(1.0, deadline - time.monotonic()))
        try:
            pairing = shm_link.connector_side(sock, self.rank, self.world_size)
        except (OSError, ConnectionError) as exc:
            sock.close()
            raise RendezvousError(
                f"rank {self.rank}: rank {peer} at {addr} dropped the transport connection during "
                f"set-up ({exc}). Is it a rank of this job, started with the same store?") from None
        self._register(peer, sock, pairing)

    def _accept_loop(self) -> None:
        while self.closed_reason is None:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock, addr), daemon=True).start()

    def _admit(self, sock: socket.socket, addr) -> None:
        """Handshake an incoming connection; close and log anything that is not a rank."""
        try:
            net.server_handshake(sock, self._token, b"transport", 10.0)
            sock.settimeout(10.0)
            hello = unpack_header(net.recv_exact(sock, HEADER_SIZE))
            session = int.from_bytes(net.recv_exact(sock, 8), "little")
            peer = hello.tag
            if hello.kind != Kind.HELLO or hello.group != self.world_size or session != self._session:
                raise ProtocolError("first frame is not a HELLO of this job")
            if not self.rank < peer < self.world_size:
                raise ProtocolError(f"HELLO names rank {peer}, which must not connect to rank {self.rank}")
            with self._conns_cv:
                if peer in self._conns:
                    raise ProtocolError(f"rank {peer} is already connected")
            self._register(peer, sock, shm_link.acceptor_side(sock, self.rank, peer, self.world_size))
        except (OSError, ConnectionError, ProtocolError, Exception) as exc:  # noqa: B014
            log.warning("chorus rank %d: rejected a transport connection from %s: %s", self.rank, addr, exc)
            sock.close()

    def _register(self, peer: int, sock: socket.socket, pairing: shm_link.Pairing | None) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        conn = _Connection(peer, sock)
        if pairing is not None:
            dead, left = self.dead, self.left  # not self: no reference cycle through the rings
            conn.ring_out, conn.ring_in = shm_link.ring_ends(
                pairing, peer=peer, bell=lambda: sock.sendall(BELL), doze=conn.reader.doze,
                gone=lambda: dead.get(peer) or ("left the job (destroy_process_group)"
                                                if peer in left else None))
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

    # -- receiving -----------------------------------------------------------------------
    def _read_loop(self, conn: _Connection) -> None:
        reader = conn.reader
        try:
            while True:
                h = unpack_header(reader.read(HEADER_SIZE))
                conn.last_heard = time.monotonic()
                if h.kind == Kind.DATA or h.kind == Kind.COLL:
                    self._read_payload(conn, reader, h)
                elif h.kind == Kind.PEER_LOST:
                    reason = LOST_REASON_TEXT.get(h.seq, "was lost")
                    self._lose(h.tag, f"{reason} (reported by rank {conn.peer})", h.seq)
                elif h.kind == Kind.ABORT:
                    self.group_mismatch(h.group, h.tag, h.seq, h.fingerprint, conn.peer)
                elif h.kind == Kind.FAILED:
                    self.peer_failed(h.tag, failed_text(reader.read(h.nbytes)), conn.peer)
                elif h.kind == Kind.BYE:
                    conn.bye = True
                    self.peer_left(conn.peer)
                elif h.kind != Kind.HEARTBEAT:
                    raise ProtocolError(f"unexpected {Kind(h.kind).name} frame after set-up")
        except ProtocolError as exc:
            if self.closed_reason is None:
                self._lose(conn.peer, f"sent an invalid frame ({exc}) and was disconnected",
                           LostReason.INVALID)
            conn.sock.close()
        except (OSError, ConnectionError) as exc:
            if self.closed_reason is None and not conn.bye:
                self._lose(conn.peer, f"died (connection lost: {exc or 'EOF'})")
        finally:
            conn.ended.set()

    def _read_payload(self, conn: _Connection, reader: BufferedReader, h: Header) -> None:
        wait = POST_GRACE_S if h.nbytes >= POST_GRACE_MIN else 0.0
        source = conn.ring_in if h.nbytes >= conn.ring_min else reader  # where the payload is
        match = self._matcher.claim(conn.peer, h, wait)
        conn.reading = True
        try:
            if isinstance(match, Handle):
                match.peer = conn.peer
                error = self._fits(match, h, conn.peer)
                if error is not None:
                    source.discard(h.nbytes)
                elif h.nbytes:
                    source.read_into(match.view)
                match.complete(h, error)
                return
            self.stashed(conn.peer, h)
            data = memoryview(np.empty(h.nbytes, np.uint8)) if h.nbytes else _EMPTY
            if h.nbytes:
                source.read_into(data)
            claimant = self._matcher.arrival_ready(match, data)
            if claimant is not None:
                self._fill_from_stash(claimant, match)
        except (OSError, ConnectionError) as exc:
            if isinstance(match, Handle):
                match.complete(error=self._lost_error(conn.peer, f"died mid-message ({exc})", h.group))
            raise
        finally:
            conn.reading = False
            conn.last_heard = time.monotonic()

    # -- sending -------------------------------------------------------------------------
    def _send_frame(self, peer: int, header: bytes, view: memoryview, handle: Handle, sync: bool) -> None:
        conn = self._conns.get(peer)
        if conn is None:
            raise ValueError(f"rank {self.rank} has no connection to rank {peer}")
        with conn.cv:
            if conn.queue or not (sync or len(view) <= INLINE_MAX):
                self._enqueue(conn, header, view, handle)
                return
            try:
                self._write(conn, header, view)
            except OSError as exc:
                handle.complete(error=self._lost_error(peer, f"died (send failed: {exc})", handle.group))
                self._lose(peer, f"died (send failed: {exc})")
                return
        handle.complete()

    def _enqueue(self, conn: _Connection, header: bytes, view: memoryview, handle: Handle | None) -> None:
        """Queue a frame for the peer's sender thread.  Caller holds ``conn.cv``."""
        conn.queue.append((header, view, handle))
        if conn.sender is None:
            conn.sender = threading.Thread(target=self._send_loop, args=(conn,),
                                           name=f"chorus-tx-r{self.rank}-to{conn.peer}", daemon=True)
            conn.sender.start()
        conn.cv.notify()

    def _send_loop(self, conn: _Connection) -> None:
        while True:
            with conn.cv:
                while not conn.queue:
                    if self.closed_reason is not None:
                        return
                    conn.cv.wait(1.0)
                header, view, handle = conn.queue[0]
                try:
                    self._write(conn, header, view)
                except OSError as exc:
                    failed = list(conn.queue)
                    conn.queue.clear()
                    error = self._lost_error(conn.peer, f"died (send failed: {exc})", 0)
                    for _, _, h in failed:
                        if h is not None:
                            h.complete(error=error)
                    if self.closed_reason is None:
                        threading.Thread(target=self._lose, args=(conn.peer, f"died (send failed: {exc})"),
                                         daemon=True).start()
                    return
                conn.queue.popleft()
                if not conn.queue:
                    conn.cv.notify_all()  # close() may be waiting for the queue to drain
            if handle is not None:
                handle.complete()

    def _write(self, conn: _Connection, header: bytes, view: memoryview) -> None:
        if len(view) >= conn.ring_min:
            conn.ring_out.write(view, lambda: conn.sock.sendall(header))
        elif len(view) <= COALESCE_MAX:
            conn.sock.sendall(header + view if len(view) else header)
        else:
            conn.sock.sendall(header)
            conn.sock.sendall(view)
        conn.last_sent = time.monotonic()

    def _fail_sends(self, pred, error_for) -> None:
        for conn in list(self._conns.values()):
            with conn.cv:
                doomed = [item for item in list(conn.queue)[1:] if item[2] is not None and pred(item[2])]
                for item in doomed:
                    conn.queue.remove(item)
            for _, _, h in doomed:
                h.complete(error=error_for(h))

    def _flush(self, timeout: float) -> None:
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
        """``peer`` is gone: tell every other rank (with why) and fail its groups here."""
        self.peer_died(peer, why, reason)

    def _notify(self, ranks: list[int], frame: bytes) -> None:
        for other in ranks:
            conn = self._conns.get(other)
            if conn is not None and other not in self.dead and not conn.bye:
                with conn.cv:
                    self._enqueue(conn, frame, _EMPTY, None)

    def _heartbeat_loop(self) -> None:
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
                            conn.sock.sendall(beat)
                            conn.last_sent = now
                    except OSError:
                        pass  # the reader notices the broken connection
                    finally:
                        conn.cv.release()
                silent = now - conn.last_heard
                if silent > limit and not conn.reading:
                    self._lose(peer, f"stopped answering (no heartbeat for {silent:.0f} s)", LostReason.SILENT)

    # -- shutdown ------------------------------------------------------------------------
    def close(self) -> None:
        """Flush queued sends (up to 5 s), say BYE to every peer, close every socket."""
        if self.closed_reason is not None:
            return
        self._flush(5.0)
        super().close()
        bye = control_header(Kind.BYE)
        for conn in list(self._conns.values()):
            with conn.cv:
                try:
                    conn.sock.sendall(bye)
                except OSError:
                    pass
                conn.cv.notify_all()
        for conn in list(self._conns.values()):
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.sock.close()
        self._listener.close()
