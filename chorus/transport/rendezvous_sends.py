"""Rendezvous sends (``CHORUS_SEND_MODE=rendezvous``): a send completes only once the
receiving rank has taken it with a receive, as torch's blocking sends do — and ranks that
wait in sends for each other are told so (DeadlockError) instead of hanging.

Protocol.  A rendezvous send travels as any send does (its payload goes at once and waits
in the receiver's stash if no receive is posted yet), but its DATA frame's ``seq`` field,
0 in other point-to-point frames, holds a request number of the sender's.  A receive that
takes such a frame answers MATCHED with that number (``Transport`` does, on whichever
thread completes the receive); only then does the send's handle complete.  A frame that
arrives and is never received leaves its send waiting, as on torch.

Deadlocks are found by edge chasing (Chandy, Misra and Haas)::

    rank 0 waits in send to 1      PROBE [0->1]          rank 1 holds 0's message unreceived
                                                         and waits in send to 0: forwards
    rank 0 holds 1's message   <-  PROBE [0->1, 1->0]
    unreceived, still waits in its send 0->1: the hops close a cycle -> DeadlockError;
    PROBE (seq 1) with the cycle to rank 1, which fails its send 1->0 the same way

A thread that has waited ``PROBE_AFTER_S`` on a rendezvous send starts a search along it,
and again every ``PROBE_EVERY_S`` while it waits.  A rank passes a probe on (its own hop
appended, along every send it waits in) only if it still holds the last hop's message
without a receive for it — that sender still waits for it — and is itself waiting in a
rendezvous send.  A probe that comes back to the rank that started it, still waiting on
its first hop, went round ranks each waiting in a send for the next, none of which
receives before its send completes.  That holds when the thread waiting in a send is the
one that would post the receive, as in single-threaded rank code; a receive another
thread of the rank posts later is not foreseen.  Probes are dropped at ``MAX_HOPS`` hops
(chorus.wire.probes).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from chorus.errors import DeadlockError
from chorus.transport.handles import Handle
from chorus.wire.frames import Kind, pack_fields
from chorus.wire.probes import MAX_HOPS, Hop, pack_hops, unpack_hops

# A send whose receive is posted completes within a round trip, far sooner than this, so
# a search (a frame per hop) is made only for sends that really wait.
PROBE_AFTER_S = 0.2
# A rank that was not waiting yet when a search passed (still computing before its send)
# is found by the next one.
PROBE_EVERY_S = 1.0

CYCLE = 1  # a PROBE frame's seq when its hops close a cycle


class SendHandle(Handle):
    """A rendezvous send: done once the peer's receive took it (``request``: its number)."""

    __slots__ = ("request",)


class RendezvousSends:
    """Rank ``rank``'s rendezvous sends that wait for their receive, and its side of the
    deadlock search.  ``notify(ranks, frame)`` sends a control frame; ``holds(source,
    request)`` says whether a message of ``source``'s send ``request`` waits here with no
    receive for it; ``group_name(id)`` names a group in messages."""

    def __init__(self, rank: int, notify: Callable[[list[int], bytes], None],
                 holds: Callable[[int, int], bool], group_name: Callable[[int], str]):
        self.rank = rank
        self._notify = notify
        self._holds = holds
        self._group_name = group_name
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        self.pending: dict[int, SendHandle] = {}  # request -> its send (read unlocked: emptiness)
        self._waited: dict[int, int] = {}  # request -> threads waiting on it now

    # -- the sender's side -------------------------------------------------------------------
    def post(self, handle: SendHandle) -> int:
        """Number ``handle`` and keep it until its MATCHED comes (or it fails)."""
        with self._lock:
            handle.request = request = next(self._numbers)
            self.pending[request] = handle
        return request

    def carrier(self, handle: SendHandle) -> Handle:
        """The handle the transport writes the frame under: a write that fails fails the send."""
        wire = Handle(handle.peer, handle.kind, handle.group, handle.tag)
        wire.add_done_callback(lambda w: w.error is not None and self.fail(handle.request, w.error))
        return wire

    def matched(self, peer: int, request: int) -> None:
        """``peer`` received the message of send ``request``: complete the send."""
        with self._lock:
            handle = self.pending.get(request)
            if handle is None or handle.peer != peer:
                return  # already failed (deadlock, timeout), or not this peer's to answer
            del self.pending[request]
        handle.complete()

    def fail(self, request: int, error: BaseException) -> None:
        with self._lock:
            handle = self.pending.pop(request, None)
        if handle is not None:
            handle.complete(error=error)

    def fail_where(self, pred: Callable[[SendHandle], bool],
                   error_for: Callable[[SendHandle], BaseException]) -> None:
        """Fail every waiting send for which ``pred`` holds with ``error_for(send)``."""
        with self._lock:
            doomed = [h for h in self.pending.values() if pred(h)]
            for h in doomed:
                del self.pending[h.request]
        for h in doomed:
            h.complete(error=error_for(h))

    # -- waiting ---------------------------------------------------------------------------
    def waiting_in(self, handles: list[Handle]) -> list[SendHandle]:
        """The rendezvous sends among ``handles`` that still wait for their receive."""
        return [h for h in handles if type(h) is SendHandle and not h.done()]

    def block(self, sends: list[SendHandle], delta: int) -> None:
        """A thread starts (``delta`` 1) or stops (-1) waiting on ``sends``."""
        with self._lock:
            for h in sends:
                count = self._waited.get(h.request, 0) + delta
                if count > 0:
                    self._waited[h.request] = count
                else:
                    self._waited.pop(h.request, None)

    def search(self, sends: list[SendHandle]) -> None:
        """Start a deadlock search along each of ``sends`` still waiting."""
        for h in sends:
            if not h.done():
                self._probe(h.peer, [Hop(self.rank, h.peer, h.tag, h.group, h.request)])

    # -- probes from peers -------------------------------------------------------------------
    def on_probe(self, source: int, seq: int, payload: bytes | memoryview) -> None:
        """A PROBE from ``source`` (``seq`` CYCLE: its hops close a cycle)."""
        hops = unpack_hops(payload)
        if seq == CYCLE:
            mine = next((hop for hop in hops if hop.rank == self.rank), None)
            if mine is not None and self._still_waiting(mine.request):
                self.fail(mine.request, self.deadlock(hops))
            return
        last = hops[-1]
        if last.rank != source or last.peer != self.rank or not self._holds(source, last.request):
            return  # that send was received meanwhile, or was never this rank's to take
        first = hops[0]
        if first.rank == self.rank:
            if self._still_waiting(first.request):
                others = sorted({hop.rank for hop in hops} - {self.rank})
                self._notify(others, pack_fields(int(Kind.PROBE), 0, 0, CYCLE, len(payload), 0, 0)
                             + pack_hops(hops))
                self.fail(first.request, self.deadlock(hops))
            return
        if any(hop.rank == self.rank for hop in hops) or len(hops) >= MAX_HOPS:
            return  # a cycle without the searching rank (its members search too), or too long
        with self._lock:
            mine = [self.pending[r] for r in self._waited if r in self.pending]
        for h in mine:
            self._probe(h.peer, [*hops, Hop(self.rank, h.peer, h.tag, h.group, h.request)])

    def _still_waiting(self, request: int) -> bool:
        with self._lock:
            return request in self.pending and request in self._waited

    def _probe(self, peer: int, hops: list[Hop]) -> None:
        payload = pack_hops(hops)
        self._notify([peer], pack_fields(int(Kind.PROBE), 0, 0, 0, len(payload), 0, 0) + payload)

    def deadlock(self, hops: list[Hop]) -> DeadlockError:
        """The error for the cycle ``hops``, told from this rank's hop on."""
        start = next(i for i, hop in enumerate(hops) if hop.rank == self.rank)
        waits = [self._wait_text(hop) for hop in hops[start:] + hops[:start]]
        rest = waits[1:]
        others = rest[0] if len(rest) == 1 else ", ".join(rest[:-1]) + " and " + rest[-1]
        return DeadlockError(
            f"deadlock: {waits[0]} while {others}; with torch's blocking sends this program hangs. "
            "Order each pair's send and receive so that one side receives first (in a ring: even "
            "ranks send first, odd ranks receive first; examples/seeds/ring_allreduce.py lets rank 0 "
            "send first), or post both at once with isend/irecv or batch_isend_irecv. "
            "CHORUS_SEND_MODE=buffered (the default) lets chorus run it as it is.")

    def _wait_text(self, hop: Hop) -> str:
        where = f"tag {hop.tag}" + ("" if hop.group == 0 else f", group {self._group_name(hop.group)}")
        return f"rank {hop.rank} waits in send to rank {hop.peer} ({where})"
