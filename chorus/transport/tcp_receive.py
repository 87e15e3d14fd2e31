"""Receiving on the TCP transport: reading frames, and which thread reads a connection.

Theory of operation
-------------------
One thread at a time reads a connection: whoever holds its :class:`ReadRole`'s lock.

* A rank thread about to block on a small receive (``Transport.progress``, called by every
  wait) takes the role and reads the peer's socket itself until the receive is complete.
  The message then costs one wake-up, this thread's, by the kernel — instead of two (the
  reader thread's, then this thread's by the reader thread) plus a hand-off of the GIL;
  on a busy host every wake-up is a trip through the scheduler.  It never blocks inside a
  header: it waits with ``poll`` and takes what the kernel has without blocking.  It lets
  go of the role once the receive is complete, with no complete frame left in the
  connection's buffer (a frame the reader thread's ``poll`` would not see), or after
  ``DIRECT_S``; a longer wait goes on the usual way, as does one for a receive larger
  than ``DIRECT_MAX`` while the same wait has other receives pending (the reader threads
  then read the peers' sockets side by side).  A lone large receive is read here: in a
  ring or recursive-doubling step it is the one message the thread waits for, and the
  reader thread's wake-up and the hand-over of the GIL cost more than its copy (W=2,
  256 KiB all_reduce: about 700 -> 420 us).  So is one whose payload comes through a
  same-host peer's shared-memory ring (chorus.transport.shm_link): on a 16-vCPU host,
  alternating runs, W=2 sendrecv took 205-219 us against 231-302 at 256 KiB, 441-552
  against 575-702 at 1 MiB, 933-1050 against 1203-1328 at 4 MiB, and two simulated hosts
  of two ranks (the ring through the hosts) led gloo in every round at 1 MiB, 1.02-2.33x,
  against 0.87-1.39x (docs/results/16-vcpu-h200-host/lone-ring-5b63e6f/).  A
  payload once begun is read to its end, whoever reads it: a peer that stalls in the
  middle of one is cut off by the heartbeat check (a payload that stops counts as
  silence), also past the op's own deadline; and an exception that a signal handler
  raises in the reading thread mid-payload (Ctrl-C) leaves the stream unreadable, so the
  peer is cut off as unreadable.
* A rank thread that sends and then waits for one small receive (``recv_now``: the TCP
  lane's steps) reads for it as above without posting it with the matcher: holding the
  role, with nothing posted or stashed that could come first, the next frame of its key
  on that connection is its own (``conn.own``).  The matcher only holds it
  (``Matcher.hold``), so failure sweeps and mismatch checks see it as a posted one.
  A collective's receive goes one step further first (``_take_now``): it knows every
  byte of the header its frame will have (the op's seq and fingerprint included), so it
  reads until the connection's next frame is exactly that one and copies its payload
  out, with no Handle, no hold and no parsing; it checks for failures between reads and
  for frames of its op stashed from other peers afterwards, and it leaves any other
  frame, unconsumed, to the path above.
* The connection's reader thread reads whenever no rank thread does: it waits for the
  socket to be readable holding nothing, takes the role, handles every frame there and
  lets go.  When it finds a rank thread reading (the role taken, or the bytes it woke for
  already gone) it parks — else every message would wake it too, for nothing — until
  ``PARK_S`` passes without a rank thread reading, or until it is needed
  (:meth:`ReadRole.need`): a rank thread let go of the role leaving a receive from the
  peer posted (its own, unfinished, or another); a wait that does not read
  for itself (the role is taken, the message is large or from any source, a send awaits
  its MATCHED); a receive posted that nobody is about to wait for.  So frames that no rank
  thread waits for (heartbeats, failure notices, EOF) are read within ``PARK_S`` at most.

Frames: for each header, the reader asks the matcher for the posted receive and reads the
payload straight into that buffer; if none is posted it stashes the payload (the reader
thread first waits a few milliseconds for a large message's receive to be posted, which in
a streaming loop saves copying the whole payload once more).  A frame that must be
stashed, or skipped because it does not fit its receive, may claim at most
``max_message_bytes()``: a claim beyond it is refused before anything is allocated and
the peer is cut off.  A read that fails — EOF, a reset, an invalid frame, anything
unforeseen, in whichever thread — cuts the peer off the same way (never silently).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from chorus.errors import CollectiveMismatchError, ProtocolError
from chorus.transport.handles import Handle
from chorus.wire.frames import (
    HEADER_SIZE,
    LOST_REASON_TEXT,
    Header,
    Kind,
    LostReason,
    abort_parties,
    failed_text,
    pack_fields,
    unpack_header,
)

log = logging.getLogger("chorus")

POST_GRACE_S = 0.005  # how long the reader thread waits for a large message's receive to be posted
POST_GRACE_MIN = 256 * 1024
DIRECT_MAX = 64 * 1024  # receives up to this size are read by the thread waiting for them, larger ones
# only when no other receive of the same wait is pending (else the reader threads read them side by side)
DIRECT_S = 0.25  # a rank thread reads for its receive this long at most, then waits the usual way
SLICE_S = 0.005  # how often a reading rank thread checks whether its receive completed elsewhere
PARK_S = 0.05  # a parked reader thread sleeps until rank threads have not read for this long
_EMPTY = memoryview(b"")
_BUSY = float("inf")  # last_heard while a receive completes (never "silent")


def _others_pending(handle: Handle, handles: list[Handle]) -> bool:
    """Whether ``handles`` hold a receive other than ``handle`` that is not complete: the
    reader threads then read them all at once, a rank thread only one after another."""
    for h in handles:
        if h.receive and not h.done() and h is not handle:
            return True
    return False


class _Taken:
    """A receive already complete (what _read_for reads behind a frame _take_now took)."""

    @staticmethod
    def done() -> bool:
        return True


_TAKEN = _Taken()


class _Expecting:
    """What _check_stash_against reads of a receive: its group and (seq, fingerprint)."""

    __slots__ = ("group", "expect")

    def __init__(self, group: int, expect: tuple[int, int]):
        self.group, self.expect = group, expect


class ReadRole:
    """Who reads one connection: ``lock`` is held by the thread reading it."""

    __slots__ = ("lock", "last_caller", "_bell")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.last_caller = -float("inf")  # time.monotonic() a rank thread last held the lock
        self._bell = threading.Event()

    def need(self) -> None:
        """Wake the reader thread if it is parked (else its next park ends at once)."""
        if not self._bell.is_set():
            self._bell.set()

    def park(self, over) -> None:
        """(The reader thread) sleep while rank threads read the connection: until none has
        held the lock for PARK_S, until :meth:`need`, or until ``over()``."""
        bell = self._bell
        while not over():
            idle = 0.0 if self.lock.locked() else time.monotonic() - self.last_caller
            if idle >= PARK_S or bell.wait(PARK_S - idle):
                break
        bell.clear()


class TcpReceiving:
    """The receiving half of ``TcpTransport`` (see the module docstring).  Expects the
    transport's ``_conns``, ``_lose`` and ``_max_message`` and the base class's matching."""

    # A point-to-point receive a waiting thread reads itself (chorus.transport.base): posting
    # one no longer wakes a parked reader thread, which would otherwise race the waiting
    # thread for it and hand it over.  sendrecv of 4 B-16 KiB on the 16-vCPU host, medians:
    # W=2 70-93 -> 48-78 us, W=4 105-120 -> 68-77 us, gloo 47-69 us in the same runs
    # (docs/results/16-vcpu-h200-host/p2p-waiter-f74997e/)
    WAITER_READS_MAX = DIRECT_MAX

    # -- the reader thread -----------------------------------------------------------------------
    def _read_loop(self, conn) -> None:
        """One per connection: read what no rank thread reads (see the module docstring)."""
        role, reader = conn.role, conn.reader
        park = False
        try:
            while not conn.broken:
                if park:
                    role.park(lambda: conn.broken or self.closed_reason is not None)
                    park = False
                if not reader.buffered():
                    reader.watch()
                if not role.lock.acquire(blocking=False):
                    park = True  # a rank thread reads
                    continue
                try:
                    if not reader.buffered() and not reader.readable(0):
                        park = True  # a rank thread took the bytes this thread woke for
                        continue
                    while not conn.broken:
                        self._read_frame(conn, POST_GRACE_S)
                        if not reader.buffered() and not reader.readable(0):
                            break
                finally:
                    role.lock.release()
        except BaseException as exc:  # noqa: BLE001 - a reader must never die silently
            self._read_failed(conn, exc)

    # -- a rank thread reading for its own receive ------------------------------------------
    def progress(self, handle: Handle, handles: list[Handle], deadline: float | None) -> None:
        """Before a wait on ``handle`` blocks: read the peer's socket in this thread until
        ``handle`` (a small receive) is complete, or for DIRECT_S at most; otherwise make
        sure the reader thread that will complete it is awake."""
        conn = self._conns.get(handle.peer) if handle.peer is not None else None
        if conn is None:  # from any source: every connection may bring it
            for other in list(self._conns.values()):
                other.role.need()
            return
        role = conn.role
        size = len(handle.view) if handle.receive and handle.view is not None else -1
        if (size < 0 or (size > DIRECT_MAX and _others_pending(handle, handles))
                or not role.lock.acquire(blocking=False)):
            role.need()
            return
        try:
            self._read_for(conn, handle, deadline)
        finally:
            role.last_caller = time.monotonic()
            role.lock.release()
            if not handle.done() or self._matcher.awaits(conn.peer) or self.sends.pending:
                role.need()

    def recv_now(self, peer: int, view: memoryview, kind: int, group: int, tag: int, dtype: int,
                 expect: tuple[int, int] | None, finish, deadline: float | None) -> Handle | None:
        """``Transport.recv_now``: when this thread can take ``peer``'s read role at once and
        no receive is posted or message stashed that could come first, the receive is not
        posted with the matcher, only held there (``Matcher.hold``: failure sweeps and
        mismatch checks still see it): this thread reads the connection, and the next frame
        of this receive's key (``conn.own``) goes straight into it, as the matcher would have
        put it (frames of other keys are handled as usual).  Otherwise, or if it is not
        complete after DIRECT_S, it is posted the usual way."""
        if not self.reads_now(peer, len(view)):
            return self.irecv(peer, view, kind=kind, group=group, tag=tag, dtype=dtype, expect=expect,
                              finish=finish, waited=True)
        conn = self._conns[peer]
        if expect is not None and self._take_now(conn, view, kind, group, tag, dtype, expect, deadline):
            failed = self._taken(peer, view, kind, group, tag, dtype, expect, finish)  # (a mismatch the stash showed)
            return failed[0] if failed else None
        handle = self._receive(peer, view, kind, group, tag, dtype, expect, finish)
        if handle.done():
            return handle
        role = conn.role
        if not role.lock.acquire(blocking=False):
            return self._post_recv(handle, True)
        matcher = self._matcher
        # Checked holding the role: no frame of this connection is stashed meanwhile.
        if matcher.stashes() or matcher.awaits(peer) or peer in self.left:
            role.lock.release()  # the wait reads, or wakes the reader thread, if it must
            return self._post_recv(handle, True)
        matcher.hold(handle)
        try:
            # Check again now that it is held, as Transport.irecv does once a receive is posted:
            # a failure recorded, or another call's frame stashed (from another peer), since
            # the checks above found nothing to fail and no receive to compare it with.
            if expect is not None and matcher.stashes():
                self._check_stash_against(handle)
            if self.failure(group, peer, receiving=True, expect=expect) is None:
                conn.own = handle
                self._read_for(conn, handle, deadline)
        except BaseException:
            matcher.unhold(handle)  # interrupted (KeyboardInterrupt): nobody reads for it any more
            raise
        finally:
            conn.own = None
            role.last_caller = time.monotonic()
            role.lock.release()
            if not handle.done() or matcher.awaits(peer) or self.sends.pending:
                role.need()
        if handle.done():
            return handle if handle.error is not None else None
        if not matcher.unhold(handle):  # a failure sweep took it meanwhile: it completes at once
            return handle
        return self._post_recv(handle, True)

    def exchange_now(self, peer: int, out: memoryview, into: memoryview, kind: int, group: int, send_tag: int,
                     recv_tag: int, seq: int, dtype: int, fingerprint: int, finish, deadline: float | None) -> list:
        """``Transport.exchange_now``: a collective's step that sends ``out`` to ``peer`` and
        receives ``into`` from it, both small, taking the read role once: the frame goes out
        whole from this thread, then ``_take_held`` reads for the reply.  Where either part
        cannot go this way, the part left goes the usual way (``send_now``/``recv_now``)."""
        conn = self._conns.get(peer)
        n_out, n_in = len(out), len(into)
        # The headers, packed before the role is taken (nothing raises while it is held); the
        # reply's is the frame's where tag and size agree (a recursive-doubling swap).
        frame = pack_fields(kind, group, send_tag, seq, n_out, dtype, fingerprint)
        reply = frame if recv_tag == send_tag and n_in == n_out else pack_fields(
            kind, group, recv_tag, seq, n_in, dtype, fingerprint)
        if (conn is None or conn.queue or max(n_out, n_in) > min(DIRECT_MAX, conn.ring_min - 1)
                or not conn.role.lock.acquire(blocking=False)):
            return super().exchange_now(peer, out, into, kind, group, send_tag, recv_tag, seq, dtype, fingerprint,
                                        finish, deadline)
        matcher, expect = self._matcher, (seq, fingerprint)
        # Checked holding the role, so that no frame of this connection can be stashed before
        # _take_held reads for the reply (it need not check again; `left` fails the send here).
        if (matcher.stashes() or matcher.awaits(peer) or peer in self.left
                or self.failure(group, peer, expect=expect) is not None):
            conn.role.lock.release()  # (the usual path wakes the reader thread if it must)
            return super().exchange_now(peer, out, into, kind, group, send_tag, recv_tag, seq, dtype, fingerprint,
                                        finish, deadline)
        try:
            sent = self._send_inline(conn, frame, out, True, None, (kind, group, send_tag, dtype))
        except BaseException:
            conn.role.lock.release()
            raise
        if sent is None and self._take_held(conn, into, reply, group, expect, deadline, checked=True):
            return self._taken(peer, into, kind, group, recv_tag, dtype, expect, finish)
        if sent is not None:
            conn.role.lock.release()
        handle = self.recv_now(peer, into, kind, group, recv_tag, dtype, expect, finish, deadline)
        return [h for h in (handle, sent) if h is not None]

    def _taken(self, peer: int, view: memoryview, kind: int, group: int, tag: int, dtype: int,
               expect: tuple[int, int], finish) -> list:
        """After ``_take_held`` took a receive's frame: run ``finish``; or, if the stash showed
        a mismatch meanwhile, the receive's handle failed with it."""
        error = self.failure(group, peer, receiving=True, expect=expect)
        if error is None:
            if finish is not None:
                finish()
            return []
        handle = Handle(peer, kind, group, tag, view, dtype)
        handle.complete(error=error)
        return [handle]

    def _take_now(self, conn, view: memoryview, kind: int, group: int, tag: int, dtype: int,
                  expect: tuple[int, int], deadline: float | None) -> bool:
        """recv_now's first try, for a collective's receive (``expect``: the op's seq and
        fingerprint, so every byte of the frame's header is known beforehand): holding the
        read role, with nothing posted or stashed that could come first, ``_take_held``."""
        role, matcher, peer = conn.role, self._matcher, conn.peer
        header = pack_fields(kind, group, tag, expect[0], len(view), dtype, expect[1])
        if matcher.stashes() or matcher.awaits(peer) or peer in self.left or not role.lock.acquire(blocking=False):
            return False
        return self._take_held(conn, view, header, group, expect, deadline)

    def _take_held(self, conn, view: memoryview, header: bytes, group: int, expect: tuple[int, int],
                   deadline: float | None, checked: bool = False) -> bool:
        """(Holding ``conn.role``, which this releases) read until the next frame of ``conn``
        is ``header`` with its payload, then copy the payload into ``view`` (Handle, matcher,
        frame parsing: none of it).  False, nothing consumed, if another frame comes first
        (the usual path handles it: a mismatch, a failure notice, a heartbeat), a failure is
        recorded, the connection fails, or DIRECT_S passes.  For its first ``spin_s`` it
        polls the socket without sleeping.  ``checked``: the caller found nothing stashed
        and no failure while holding the role already."""
        role, matcher, peer = conn.role, self._matcher, conn.peer
        reader = conn.reader
        took = False
        now, until = 0.0, None  # (the clock is read once a read finds nothing)
        try:
            # (checked holding the role: no frame of this connection is stashed meanwhile)
            if not checked and (matcher.stashes()
                                or self.failure(group, peer, receiving=True, expect=expect) is not None):
                return False
            while not conn.broken:
                got = reader.take(header, view)
                if got:
                    took = got > 0
                    break
                if reader.fill_nowait():
                    continue
                now = time.monotonic()
                if until is None:
                    until = now + DIRECT_S if deadline is None else min(deadline, now + DIRECT_S)
                    spin_until = now + self.spin_s
                if now >= until:
                    break
                if now < spin_until:
                    continue
                if matcher.stashes():  # stashed() compares new stashes with posted and held receives
                    self._check_stash_against(_Expecting(group, expect))  # only, and this one is neither
                if self.failure(group, peer, receiving=True, expect=expect):
                    break
                reader.readable(SLICE_S)
            now = time.monotonic()
            if took:
                conn.last_heard = now
            # Frames behind it, or the other frame that came first: read those here in full now,
            # which the reader thread's poll would miss (the usual path may fail at once, unread).
            if reader.frame_buffered() >= 0:
                self._read_for(conn, _TAKEN, deadline)
                now = time.monotonic()
            if took and matcher.stashes():  # another peer's frame of this op or an earlier one, stashed meanwhile
                self._check_stash_against(_Expecting(group, expect))
        except OSError as exc:  # EOF, a reset: the peer is cut off as _read_for does; the usual path reports it
            self._read_failed(conn, exc)
        finally:
            role.last_caller = now or time.monotonic()
            role.lock.release()
            if matcher.awaits(peer) or self.sends.pending:
                role.need()
        return took

    def reads_now(self, peer: int, nbytes: int) -> bool:
        """``Transport.reads_now``: a receive small enough to be read here whose payload
        comes over the socket (not through a ring)."""
        conn = self._conns.get(peer)
        return conn is not None and nbytes <= DIRECT_MAX and nbytes < conn.ring_min

    def _read_for(self, conn, handle: Handle, deadline: float | None) -> None:
        """(Holding ``conn.role``) read ``conn`` until ``handle`` is complete, or for
        DIRECT_S at most (see the module docstring)."""
        reader = conn.reader
        now = conn.role.last_caller = time.monotonic()
        until = now + DIRECT_S if deadline is None else min(deadline, now + DIRECT_S)
        inside = False  # in the middle of a frame: if interrupted, the stream is lost
        try:
            while not conn.broken:
                n = reader.frame_buffered()
                # A frame whose header is here is read now, waiting for its payload if need
                # be; once the receive is complete, only frames already here in full (or
                # whose payload comes through the ring), so that none is left buffered
                # where the reader thread's poll would not see it.
                if n >= 0 and (not handle.done() or n >= conn.ring_min or HEADER_SIZE + n <= reader.buffered()):
                    inside = True
                    self._read_frame(conn, 0.0)
                    inside = False
                    continue
                if handle.done():
                    break
                if reader.fill_nowait():
                    continue
                left = until - time.monotonic()
                if left <= 0:
                    break
                reader.readable(min(left, SLICE_S))
        except BaseException as exc:
            if isinstance(exc, Exception) or inside:
                self._read_failed(conn, exc)
            if not isinstance(exc, Exception):
                raise

    def _attend(self, peer: int | None) -> None:
        """A receive from ``peer`` (None: any) was posted that nobody is about to wait for:
        the reader threads that can complete it must not stay parked."""
        conns = list(self._conns.values()) if peer is None else [self._conns.get(peer)]
        for conn in conns:
            if conn is not None:
                conn.role.need()

    # -- frames ------------------------------------------------------------------------------
    def _read_frame(self, conn, grace: float) -> None:
        """Read and act on one frame (the caller holds ``conn.role``)."""
        reader = conn.reader
        h = unpack_header(reader.read(HEADER_SIZE))
        conn.last_heard = time.monotonic()
        if h.kind == Kind.DATA or h.kind == Kind.COLL:
            self._read_payload(conn, reader, h, grace)
        elif h.kind == Kind.PROBE:
            payload = reader.read(h.nbytes)
            if conn.peer not in self.dead:
                self.on_probe(conn.peer, h.seq, payload)
        elif conn.peer in self.dead:
            return  # a rank given up on is not believed about the others
        elif h.kind == Kind.MATCHED:
            self.sends.matched(conn.peer, h.seq)
        elif h.kind == Kind.PEER_LOST:
            reason = LOST_REASON_TEXT.get(h.seq, "was lost")
            self._lose(h.tag, f"{reason} (reported by rank {conn.peer})", h.seq)
        elif h.kind == Kind.ABORT:
            culprit, detector = abort_parties(h.tag, conn.peer)
            self.group_mismatch(h.group, culprit, h.seq, h.fingerprint, detector)
        elif h.kind == Kind.FAILED:
            self.peer_failed(h.tag, failed_text(reader.read(h.nbytes)), conn.peer)
        elif h.kind == Kind.BYE:
            conn.bye = True
            self.peer_left(conn.peer)
        elif h.kind != Kind.HEARTBEAT:
            raise ProtocolError(f"unexpected {Kind(h.kind).name} frame after set-up")

    def _read_failed(self, conn, exc: BaseException) -> None:
        """Reading ``conn`` failed with ``exc`` (in the reader thread or a rank thread): no
        thread reads it again, and unless the peer said BYE or this rank is closing, the
        peer is lost (an invalid frame or a failed reader also closes the socket)."""
        already = conn.broken
        conn.broken = True
        try:
            if already:
                return
            if isinstance(exc, ProtocolError):
                if self.closed_reason is None:
                    self._lose(conn.peer, f"sent an invalid frame ({exc}) and was disconnected",
                               LostReason.INVALID)
                conn.sock.close()
            elif isinstance(exc, (OSError, ConnectionError)):
                if self.closed_reason is None and not conn.bye:
                    self._lose(conn.peer, f"died (connection lost: {exc or 'EOF'})")
            else:
                if isinstance(exc, Exception):
                    log.error("chorus rank %d: reading rank %d's connection failed", self.rank, conn.peer,
                              exc_info=exc)
                if self.closed_reason is None:
                    self._lose(conn.peer, f"could not be read from any more (rank {self.rank}'s reader failed: "
                                          f"{type(exc).__name__}: {exc})", LostReason.UNREADABLE)
                conn.sock.close()
        finally:
            conn.ended.set()
            conn.role.need()  # a parked reader thread ends now

    def _read_payload(self, conn, reader, h: Header, grace: float) -> None:
        """Read one payload into its posted receive, or stash it.  Its claimed length is
        checked first: a frame that must be buffered or skipped may claim at most
        ``max_message_bytes()``, else nothing is allocated and the peer is disconnected."""
        wait = grace if h.nbytes >= POST_GRACE_MIN else 0.0
        source = conn.ring_in if h.nbytes >= conn.ring_min else reader  # where the payload is
        own = conn.own
        if (own is not None and own.kind == h.kind and own.group == h.group and own.tag == h.tag
                and self._matcher.unhold(own)):
            match = own  # the receive the reading thread holds back from the matcher
            conn.own = None
        else:
            match = self._matcher.claim(conn.peer, h, wait)
        conn.reading = True
        try:
            if isinstance(match, Handle):
                match.peer = conn.peer
                error = self._fits(match, h, conn.peer)
                if error is None:
                    if h.nbytes:
                        source.read_into(match.view)
                    conn.reading, conn.last_heard = False, _BUSY
                    match.complete(h)  # may reduce for a while: this rank's work, not peer silence
                    if h.seq and h.kind == Kind.DATA:
                        self.answer(conn.peer, h)
                    return
                match.complete(h, error)  # the receive fails at once, before the skip
                if h.seq and h.kind == Kind.DATA:
                    self.answer(conn.peer, h)
                self._check_claim(h, "skip", error)
                source.discard(h.nbytes)
                return
            self.stashed(conn.peer, h)
            self._check_claim(h, "buffer")
            try:
                data = memoryview(np.empty(h.nbytes, np.uint8)) if h.nbytes else _EMPTY
            except MemoryError:
                raise MemoryError(f"a {Kind(h.kind).name} frame of {h.nbytes} bytes arrived before its "
                                  "receive was posted and this rank has no memory to buffer it") from None
            if h.nbytes:
                source.read_into(data)
            conn.reading, conn.last_heard = False, _BUSY
            claimant = self._matcher.arrival_ready(match, data)
            if claimant is not None:
                self._fill_from_stash(claimant, match)
        except Exception as exc:
            if isinstance(match, Handle):  # claimed: no failure sweep finds it any more
                why = (f"died mid-message ({exc})" if isinstance(exc, OSError)
                       else f"could not be read from ({type(exc).__name__}: {exc})")
                match.complete(error=self._lost_error(conn.peer, why, h.group))
            raise
        finally:
            conn.reading = False
            conn.last_heard = time.monotonic()

    def _check_claim(self, h: Header, what: str, error: BaseException | None = None) -> None:
        """ProtocolError if a frame that this rank must ``what`` ("buffer": no receive is
        posted; "skip": it fails its receive with ``error``) claims too many bytes."""
        if h.nbytes <= self._max_message:
            return
        why = ("no receive for it is posted" if error is None
               else "it belongs to another collective call" if isinstance(error, CollectiveMismatchError)
               else "it does not fit its posted receive")
        raise ProtocolError(
            f"a {Kind(h.kind).name} frame claims {h.nbytes} bytes, which this rank would have to {what} "
            f"({why}): more than the limit of {self._max_message} bytes (CHORUS_MAX_MESSAGE_BYTES; "
            "unset: this host's physical memory)")
