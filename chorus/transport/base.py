"""The one interface every transport implements, and what they all share.

A transport moves byte regions between the ranks of one job.  Callers post sends and
receives (``isend`` / ``irecv``) of a memoryview to or from a peer (global rank) under
a key ``(kind, group, tag)`` and get a :class:`Handle` to wait on.  Subclasses only
implement :meth:`Transport._send_frame` (and connection management); matching, buffer
checks and failure handling live here so that every transport behaves the same.

Failures are scoped by group: a peer that dies fails every pending and later transfer
of every group that contains it (the op could never finish); a peer that leaves cleanly
(``destroy_process_group``) fails only transfers addressed to it.  A peer that fails by
raising counts as dead, its error ("ValueError: ...") named in every error it causes.

Waits that last report who they wait for (chorus.transport.waiting); sends posted with
``rendezvous`` complete only once the peer's receive took them, and waits on them search
for deadlocks (chorus.transport.rendezvous_sends).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from chorus.errors import AbortedError, BufferMismatchError, CollectiveMismatchError, PeerLostError
from chorus.transport.handles import Handle, wait_all
from chorus.transport.matching import Arrival, Matcher
from chorus.transport.rendezvous_sends import RendezvousSends, SendHandle
from chorus.transport.waiting import WaitReport, wait_long
from chorus.wire.dtypes import dtype_name
from chorus.wire.fingerprint import describe, describe_calls, describe_report
from chorus.wire.frames import Header, Kind, LostReason, abort_tag, pack_failed, pack_fields

log = logging.getLogger("chorus")

DATA = int(Kind.DATA)
MISMATCH_SETTLE_S = 1.0  # a rank raising a mismatch waits this long for the others' calls, to name them


class Transport:
    """Base class: matching, checks and failure scoping.  See the module docstring."""

    name = "base"
    #: p2p receives up to this many bytes are posted as ``waited`` (chorus.api.p2p says which):
    #: the Work's waiter reads them, a poll or future ``attend``s them.  Base: 0 (none).
    WAITER_READS_MAX = 0

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self._matcher = Matcher()
        self._state_lock = threading.Lock()
        self._groups: dict[int, frozenset[int]] = {0: frozenset(range(world_size))}
        # Public state, read (never written) by the components above the transport; an
        # attribute read is what the latency paths can afford per op.
        self.dead: dict[int, str] = {}  # rank -> why (died: fails its groups)
        self.left: set[int] = set()  # ranks that said BYE (fails transfers addressed to them)
        self.raised: dict[int, str] = {}  # rank -> its error ("ValueError: ..."): it failed by raising
        self.mismatched: dict[int, str] = {}  # group -> why it is unusable (collective mismatch)
        self.mismatched_at: dict[int, int] = {}  # group -> the op number where it broke
        self.finished_seq: dict[int, int] = {}  # group -> seq of the last collective finished here
        self.finished_call: dict[int, tuple[int, int]] = {}  # group -> (seq, fingerprint) of it (engine)
        # group -> global rank -> (seq, fingerprint) of its call where the group broke, as
        # each rank says of itself and its detectors say of it (for the mismatch message)
        self.calls: dict[int, dict[int, tuple[int, int]]] = {}
        self._calls_cv = threading.Condition(self._state_lock)
        self._told_calls: set[int] = set()  # groups whose members were told this rank's call
        self._settled: set[int] = set()  # groups whose calls were awaited once already
        self._why: dict[int, str] = {}  # group -> what its calls do not show (mismatch_error)
        # group -> its first report of another rank's call: (culprit, detector, seq, fingerprint)
        self._seen: dict[int, tuple[int, int, int, int]] = {}
        self.closed_reason: str | None = None
        self.abandoned: dict[int, tuple[int, str]] = {}  # group -> (seq, why): abandon()
        # Whether every peer proved the job token (the TCP transport with a token, given or
        # derived for a job on one host: chorus.host.secret): object
        # collectives unpickle anything only from authenticated peers (chorus.api.safe_pickle).
        self.authenticated = False
        self._listeners: list[Callable[[int, str], None]] = []
        self.wait_reports: dict[int, WaitReport] = {}  # group -> its waiting reports
        self.sends = RendezvousSends(rank, self._notify, self._holds_unreceived, self._group_name)

    # -- failure listeners -------------------------------------------------------------------
    def add_failure_listener(self, listener: Callable[[int, str], None]) -> None:
        """Call ``listener(group, why)`` whenever a failure is recorded here: ``group`` -1
        for a dead rank (every group containing it fails), else the group a collective
        mismatch broke.  It runs on the thread that noticed (a reader thread, say): it
        must be quick and must not block (wake a waiter, set an abort flag)."""
        with self._state_lock:
            self._listeners.append(listener)

    def remove_failure_listener(self, listener: Callable[[int, str], None]) -> None:
        with self._state_lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _tell_listeners(self, group: int, why: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(group, why)
            except Exception:  # noqa: BLE001 - a listener must not stop failure handling
                log.exception("chorus rank %d: a failure listener raised", self.rank)

    # -- groups --------------------------------------------------------------------------
    def register_group(self, group: int, members: Iterable[int], report: WaitReport | None = None) -> None:
        """``members``: the ranks whose failure fails ``group``'s transfers; ``report``: the
        group's waiting reports (kept from an earlier call when None)."""
        with self._state_lock:
            self._groups[group] = frozenset(members)
            if report is not None:
                self.wait_reports[group] = report

    def _group_name(self, group: int) -> str:
        report = self.wait_reports.get(group)
        return report.group if report is not None else str(group)

    # -- posting ---------------------------------------------------------------------------
    def isend(self, peer: int, view: memoryview, *, kind: int, group: int, tag: int,
              seq: int = 0, dtype: int = 0, fingerprint: int = 0, sync: bool = False,
              rendezvous: bool = False) -> Handle:
        """Post a send of ``view`` to ``peer``; ``sync`` hints that the caller waits at once.
        ``rendezvous`` (point-to-point only): the handle completes once ``peer`` has taken
        the message with a receive, not once it is on its way."""
        if rendezvous:
            return self._isend_rendezvous(peer, view, kind, group, tag, dtype, sync)
        handle = Handle(peer, kind, group, tag, view, dtype)
        error = self.failure(group, peer, expect=(seq, fingerprint) if fingerprint else None)
        if error is not None:
            handle.complete(error=error)
            return handle
        header = pack_fields(kind, group, tag, seq, len(view), dtype, fingerprint)
        self._send_frame(peer, header, view, handle, sync)
        return handle

    def _isend_rendezvous(self, peer: int, view: memoryview, kind: int, group: int, tag: int,
                          dtype: int, sync: bool) -> Handle:
        handle = SendHandle(peer, kind, group, tag, view, dtype)
        error = self.failure(group, peer)
        if error is not None:
            handle.complete(error=error)
            return handle
        request = self.sends.post(handle)
        # the frame's seq carries the request number: the receive answers MATCHED with it
        self._send_frame(peer, pack_fields(kind, group, tag, request, len(view), dtype, 0), view,
                         self.sends.carrier(handle), sync)
        error = self.failure(group, peer)  # a failure recorded meanwhile found nothing to fail
        if error is not None:
            self.sends.fail(request, error)
        return handle

    def irecv(self, peer: int | None, view: memoryview, *, kind: int, group: int, tag: int,
              dtype: int = 0, expect: tuple[int, int] | None = None,
              finish: Callable[[], None] | None = None, waited: bool = False) -> Handle:
        """Post a receive into ``view`` from ``peer`` (None = any member of ``group``).

        ``expect``: the (seq, fingerprint) of this rank's collective; a message of another
        call fails the receive with CollectiveMismatchError and aborts the group everywhere.
        ``finish``: run by whichever thread completes the receive, before anyone waiting on
        it wakes (so e.g. a reduction overlaps with this thread's other work).
        ``waited``: the caller waits for it at once through :meth:`wait_all` (which lets
        the transport read for it in that thread); else the transport makes sure it
        completes without a waiter (see :meth:`progress`)."""
        handle = self._receive(peer, view, kind, group, tag, dtype, expect, finish)
        return handle if handle.done() else self._post_recv(handle, waited)

    def _receive(self, peer, view, kind, group, tag, dtype, expect, finish) -> Handle:
        """A receive's Handle (irecv's arguments), failed at once if its group or peer has."""
        handle = Handle(peer, kind, group, tag, view, dtype, expect, finish)
        handle.receive = True
        error = self.failure(group, peer, receiving=True, expect=expect)
        if error is not None:
            handle.complete(error=error)
        return handle

    def _post_recv(self, handle: Handle, waited: bool) -> Handle:
        """Post ``handle`` (a receive that passed ``failure``) with the matcher; returns it."""
        peer, group, expect = handle.peer, handle.group, handle.expect
        arrival = self._matcher.post(handle)
        if arrival is not None:
            self._fill_from_stash(handle, arrival)
            return handle
        if not waited:
            self._attend(peer)
        if expect is not None and self._matcher.stashes():
            self._check_stash_against(handle)
        # Check again now that the receive is posted: a failure recorded between the first
        # check and the post found nothing to fail (flags are set before the sweep).
        error = self.failure(group, peer, receiving=True, expect=expect)
        if error is not None:
            self._matcher.cancel(handle)
            handle.complete(error=error)
        elif peer in self.left and not handle.done():
            # The peer left; what it sent before leaving has been matched above.
            self._matcher.cancel(handle)
            handle.complete(error=self._lost_error(peer, "left the job (destroy_process_group) "
                                                         "without sending this message", group))
        return handle

    def send_now(self, peer: int, view: memoryview, kind: int, group: int, tag: int, seq: int, dtype: int,
                 fingerprint: int) -> Handle | None:
        """A send the caller waits for at once (``isend`` with ``sync``): None once it is on its
        way, else its handle (pending, or failed) for :meth:`wait_all`.  Base: the handle always."""
        return self.isend(peer, view, kind=kind, group=group, tag=tag, seq=seq, dtype=dtype,
                          fingerprint=fingerprint, sync=True)

    def recv_now(self, peer: int, view: memoryview, kind: int, group: int, tag: int, dtype: int,
                 expect: tuple[int, int] | None, finish: Callable[[], None] | None,
                 deadline: float | None) -> Handle | None:
        """A receive from ``peer`` the caller waits for at once (``irecv`` with ``waited``): None
        once it completed without error, else its handle (pending, or failed) for :meth:`wait_all`."""
        return self.irecv(peer, view, kind=kind, group=group, tag=tag, dtype=dtype, expect=expect,
                          finish=finish, waited=True)

    def exchange_now(self, peer: int, out: memoryview, into: memoryview, kind: int, group: int, send_tag: int,
                     recv_tag: int, seq: int, dtype: int, fingerprint: int, finish: Callable[[], None] | None,
                     deadline: float | None) -> list[Handle]:
        """Op ``seq``'s step that sends ``out`` to ``peer`` and receives ``into`` (small) from
        it: what is left to wait for, receive first ([] once both are done and ``finish``
        ran).  Base: :meth:`send_now`, then :meth:`recv_now`."""
        sent = self.send_now(peer, out, kind, group, send_tag, seq, dtype, fingerprint)
        handle = self.recv_now(peer, into, kind, group, recv_tag, dtype, (seq, fingerprint), finish, deadline)
        return [h for h in (handle, sent) if h is not None]

    def reads_now(self, peer: int, nbytes: int) -> bool:
        """Whether :meth:`recv_now` reads a receive of ``nbytes`` from ``peer`` in the calling
        thread, so that it may follow the caller's sends; else post it before them, where
        its message can land while they are written.  Base: False."""
        return False

    def wait_all(self, handles: list[Handle], deadline: float | None, what: Callable[[], str],
                 give_up: bool = True, label: Callable[[], str] | None = None) -> None:
        """Wait for ``handles``; raise CommTimeoutError at the deadline and re-raise a
        handle's error with the op's description prepended.

        ``give_up``: the deadline is the op's own, so on timeout withdraw its receives (no
        late message may land in a buffer nobody owns any more).  False for a caller's
        shorter ``Work.wait(timeout)``, after which the op may still complete.
        ``label()`` names the op in waiting reports ("all_reduce #6"; default ``what()``).
        """
        try:
            wait_all(handles, deadline, what, self, label)
        except PeerLostError as exc:
            raise PeerLostError(f"{what()}: {exc}", exc.lost_rank, exc.reporter) from None
        except TimeoutError:
            if give_up:
                for h in handles:
                    if not h.done():
                        self._matcher.cancel(h)
                        if type(h) is SendHandle:
                            self.sends.fail(h.request, AbortedError("the send timed out"))
            raise

    def progress(self, handle: Handle, handles: list[Handle], deadline: float | None) -> None:
        """Before a wait on ``handle`` (one of ``handles``, not done) blocks: move it on in this
        thread if the transport can (TCP reads a small receive's socket here, until ``deadline`` at
        most), else make sure it completes without this thread.  Base: nothing."""

    def _attend(self, peer: int | None) -> None:
        """A receive from ``peer`` (None: any) was posted with no waiter about to call :meth:`progress`:
        make sure it completes without one.  Base: nothing to do."""

    def attend(self, handles: list[Handle]) -> None:
        """:meth:`_attend` the receives among ``handles`` not done (a Work polled or given a future)."""
        for h in handles:
            if h.receive and not h.done():
                self._attend(h.peer)

    def wait_long(self, handle: Handle, handles: list[Handle], deadline: float | None,
                  label: Callable[[], str]) -> None:
        """Wait for ``handle`` (one of ``handles``, not done) in slices
        (:func:`chorus.transport.waiting.wait_long`, with the group's WaitReport)."""
        wait_long(handle, handles, deadline, label, self.wait_reports.get(handle.group), self.sends)

    # -- for subclasses ------------------------------------------------------------------------
    def _send_frame(self, peer: int, header: bytes, view: memoryview, handle: Handle, sync: bool) -> None:
        raise NotImplementedError

    def _fits(self, handle: Handle, header: Header, source: int) -> BaseException | None:
        """An error if the arriving message does not fit the posted receive.

        A collective receive that gets another call's frame also aborts the group.
        """
        if handle.expect is not None and handle.expect != (header.seq, header.fingerprint):
            self.group_mismatch(header.group, source, header.seq, header.fingerprint, self.rank)
            return self.mismatch_error(header.group, handle.expect)
        nbytes = len(handle.view) if handle.view is not None else 0
        if header.nbytes == nbytes and (header.dtype == handle.dtype or not header.dtype or not handle.dtype):
            return None
        return BufferMismatchError(
            f"recv from rank {source} (tag {header.tag}, group {header.group}): the message holds "
            f"{header.nbytes} bytes of {dtype_name(header.dtype)} but the receive buffer has "
            f"{nbytes} bytes of {dtype_name(handle.dtype)}. Post a buffer of the same dtype "
            "and number of elements as the sender's tensor."
        )

    def _fill_from_stash(self, handle: Handle, arrival: Arrival) -> None:
        """Complete ``handle`` from a fully received stashed message."""
        handle.peer = arrival.peer
        header = arrival.header
        error = self._fits(handle, header, arrival.peer)
        if error is None and header.nbytes:
            handle.view[:] = arrival.data
        handle.complete(header, error)
        if header.seq and header.kind == DATA:
            self.answer(arrival.peer, header)

    def answer(self, source: int, header: Header) -> None:
        """A receive took ``source``'s rendezvous send ``header`` (a DATA frame whose seq is
        its request number): tell ``source``, whose send completes then."""
        self._notify([source], pack_fields(int(Kind.MATCHED), header.group, header.tag, header.seq, 0, 0, 0))

    def _holds_unreceived(self, source: int, request: int) -> bool:
        """Whether ``source``'s rendezvous send ``request`` arrived here and no receive took it."""
        return self._matcher.find_unexpected(
            lambda a: a.peer == source and a.header.seq == request and a.header.kind == DATA) is not None

    def on_probe(self, source: int, seq: int, payload: bytes | memoryview) -> None:
        """A PROBE frame from ``source`` (chorus.transport.rendezvous_sends)."""
        if self.closed_reason is None:
            self.sends.on_probe(source, seq, payload)

    def failure(self, group: int, peer: int | None, receiving: bool = False,
                 expect: tuple[int, int] | None = None) -> BaseException | None:
        """The error a new transfer of ``group`` (to or from ``peer``; ``expect``: the op's
        (seq, fingerprint)) must fail with right away, if any: a closed transport, a
        mismatch in the group, a dead member, a peer that left."""
        if self.closed_reason is not None:
            return AbortedError(f"the transport is closed ({self.closed_reason}); re-initialise first")
        if not self.dead and not self.left and not self.mismatched and not self.abandoned:
            return None
        gave_up = self.abandoned.get(group)
        if gave_up is not None and expect is not None and expect[0] == gave_up[0]:
            return AbortedError(gave_up[1])
        if group in self.mismatched and (expect is None or expect[0] >= self.mismatched_at[group]):
            return self.mismatch_error(group, expect)
        members = self._groups.get(group, ())
        for rank, why in self.dead.items():
            if rank in members:
                return self._lost_error(rank, why, group)
        if peer is not None and peer in self.left and not receiving:
            return self._lost_error(peer, "left the job (destroy_process_group)", group)
        return None

    def abandon(self, group: int, seq: int, why: str) -> None:
        """Op ``seq`` of ``group`` failed on another transport of this rank (chorus.components.
        channels): its receives here, pending or to come, fail with AbortedError(``why``),
        and its frames that arrive later are not taken for another op's (no mismatch)."""
        with self._state_lock:
            self.abandoned[group] = (seq, why)
        self._matcher.fail_where(lambda h: h.group == group and h.expect is not None and h.expect[0] == seq,
                                 lambda h: AbortedError(why))
        self._matcher.discard_where(lambda a: a.header.kind == Kind.COLL and a.header.group == group
                                    and a.header.seq == seq)

    def _lost_error(self, rank: int, why: str, group: int,
                    handle: Handle | None = None) -> PeerLostError | CollectiveMismatchError:
        """PeerLostError for ``rank`` — or for the root cause when there is one: a collective
        mismatch in ``group``, or a member of ``group`` that died (peers often leave
        *because* of it, and the thread relaying it may not have reached this op yet)."""
        if group in self.mismatched:
            return self.mismatch_error(group, handle.expect if handle else None)
        members = self._groups.get(group, ())
        dead = next((r for r in self.dead if r in members), None)
        if dead is not None:
            rank, why = dead, self.dead[dead]
        return PeerLostError(
            f"rank {rank} {why}; every op of group {group} involving it fails on every rank. "
            f"Look at rank {rank}'s output for its own error.",
            lost_rank=rank,
        )

    def peer_died(self, rank: int, why: str, reason: int = LostReason.DIED,
                  notice: bytes | None = None) -> bool:
        """Record that ``rank`` died: tell every other rank (PEER_LOST, or ``notice``), then
        fail everything pending here in its groups.  Telling first means a rank that fails
        and leaves at once cannot overtake its own notice.  False if this was already known."""
        with self._state_lock:
            if rank in self.dead or self.closed_reason is not None:
                return False
            self.dead[rank] = why
            doomed = {g for g, members in self._groups.items() if rank in members}
            self._calls_cv.notify_all()  # a mismatch's settling waits for no word from it
        log.warning("chorus rank %d: rank %d %s", self.rank, rank, why)
        self._tell_listeners(-1, f"rank {rank} {why}")
        notice = notice or pack_fields(int(Kind.PEER_LOST), 0, rank, int(reason), 0, 0, 0)
        self._notify([r for r in range(self.world_size) if r not in (rank, self.rank)], notice)
        self._matcher.fail_where(lambda h: h.group in doomed,
                                 lambda h: self._lost_error(rank, why, h.group, h))
        self._fail_sends(lambda h: h.group in doomed, lambda h: self._lost_error(rank, why, h.group))
        self.sends.fail_where(lambda h: h.group in doomed, lambda h: self._lost_error(rank, why, h.group))
        return True

    def peer_failed(self, rank: int, text: str, reporter: int) -> bool:
        """``rank`` failed with the error ``text`` ("ValueError: ..."), as it said itself
        (``reporter == rank``) or as a peer passed on: record it, pass it on to the other
        ranks (FAILED, with the text) and fail its groups here, as :meth:`peer_died` does."""
        with self._state_lock:
            self.raised.setdefault(rank, text)
        by = "" if reporter == rank else f" (reported by rank {reporter})"
        return self.peer_died(rank, f"failed with {text}{by}", notice=pack_failed(rank, text))

    def report_failure(self, text: str, timeout: float = 2.0) -> None:
        """This rank is failing with the error ``text``: tell every peer (FAILED, so that their
        errors name this cause rather than a lost connection), wait up to ``timeout`` seconds
        for the notices to leave, then stop - without BYE: the peers must not take the
        failure for a clean leave.  The connections stay open until the process exits, so
        that a peer can tell when it has (:meth:`wait_exited`)."""
        if self.closed_reason is not None:
            return
        self._notify([r for r in range(self.world_size) if r != self.rank], pack_failed(self.rank, text))
        self.flush(timeout)
        with self._state_lock:
            if self.closed_reason is None:
                self.closed_reason = f"this rank failed ({text})"
        self._matcher.fail_where(lambda h: True, lambda h: AbortedError(
            f"this rank failed ({text}) while this receive was pending"))
        self.sends.fail_where(lambda h: True, lambda h: AbortedError(
            f"this rank failed ({text}) while this send waited for its receive"))

    def wait_exited(self, rank: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the process of ``rank`` has exited (its
        connection closed); True once it has.  Transports without processes return False
        at once."""
        return False

    def peer_left(self, rank: int) -> None:
        """``rank`` said BYE: fail receives addressed to it; it will send nothing more."""
        with self._state_lock:
            self.left.add(rank)
            self._calls_cv.notify_all()
        why = "left the job (destroy_process_group) before sending"
        self._matcher.fail_where(lambda h: h.peer == rank, lambda h: self._lost_error(rank, why, h.group, h))
        unreceived = "left the job (destroy_process_group) without receiving this send"
        self.sends.fail_where(lambda h: h.peer == rank, lambda h: self._lost_error(rank, unreceived, h.group))

    def group_mismatch(self, group: int, culprit: int, seq: int, fingerprint: int, detector: int) -> None:
        """Rank ``culprit`` called another collective (``seq``, ``fingerprint``) in ``group``
        (or, told by ``culprit`` itself, this is its call there): note that call, and the
        first time fail every pending receive of the group here, tell the other members
        (once) and what this rank called there if it finished that op already."""
        why = (f"rank {culprit} called {describe(fingerprint)} as op #{seq} of group {group}"
               f" (reported by rank {detector})")
        if culprit != self.rank:
            self.note_calls(group, {culprit: (seq, fingerprint)})
        with self._state_lock:
            if culprit != detector:  # (not a rank telling its own call)
                self._seen.setdefault(group, (culprit, detector, seq, fingerprint))
            if group in self.mismatched or self.closed_reason is not None:
                return
            if culprit == self.rank:  # the notice below tells the others this rank's own call
                self._told_calls.add(group)
            self.mismatched[group] = why
            self.mismatched_at[group] = seq
            members = sorted(self._groups.get(group, ()))
        log.error("chorus rank %d: collective mismatch: %s", self.rank, why)
        self._tell_listeners(group, why)
        notice = pack_fields(int(Kind.ABORT), group, abort_tag(culprit, detector), seq, 0, 0, fingerprint)
        self._notify([m for m in members if m != self.rank], notice)  # tell first, then fail here
        mine = self.finished_call.get(group)
        if mine is not None and mine[0] == seq:  # this rank's part of that op completed
            self._tell_own_call(group, mine)
        # ops before the mismatched one (a slow rank's barrier, say) may still complete
        self._matcher.fail_where(lambda h: h.group == group and (h.expect is None or h.expect[0] >= seq),
                                 lambda h: self.mismatch_error(group, h.expect))

    def note_calls(self, group: int, calls: dict[int, tuple[int, int]]) -> None:
        """Record what ranks called where ``group`` broke: global rank -> (seq,
        fingerprint).  The first word about a rank stands."""
        with self._calls_cv:
            known = self.calls.setdefault(group, {})
            for rank, call in calls.items():
                known.setdefault(rank, call)
            self._calls_cv.notify_all()

    def _tell_own_call(self, group: int, call: tuple[int, int]) -> None:
        """Note this rank's call where ``group`` broke and tell the other members (once):
        an ABORT frame naming this rank itself."""
        self.note_calls(group, {self.rank: call})
        with self._state_lock:
            if group in self._told_calls or self.closed_reason is not None:
                return
            self._told_calls.add(group)
            members = sorted(self._groups.get(group, ()))
        notice = pack_fields(int(Kind.ABORT), group, abort_tag(self.rank, self.rank), call[0], 0, 0, call[1])
        self._notify([m for m in members if m != self.rank], notice)

    def mismatch_error(self, group: int, expect: tuple[int, int] | None,
                       why: str | None = None) -> CollectiveMismatchError:
        """The CollectiveMismatchError of broken ``group`` for this rank's op ``expect``
        ((seq, fingerprint); None outside a collective), naming every distinct call known
        and the ranks that made it; ``why`` (kept for the group's later errors) explains a
        mismatch the calls do not show: equal calls run different ways."""
        if expect is not None:
            done, at = self.finished_call.get(group), self.mismatched_at.get(group)
            # raised in a later op: this rank's part of the broken one had completed
            self._tell_own_call(group, done if done and done[0] == at and expect[0] > at else expect)
        with self._state_lock:
            if why:
                self._why.setdefault(group, why)
            why = self._why.get(group)
            members = sorted(self._groups.get(group, ()))
            calls = dict(self.calls.get(group, {}))
            seen = self._seen.get(group)
        text = describe_calls(calls, members)
        if len(set(calls.values())) < 2:  # the calls do not show it (yet)
            if why:
                text = f"{why}; {text}"
            else:
                text += describe_report(calls, members, seen)
        return CollectiveMismatchError(
            f"collective mismatch on group {group} (this rank is rank {self.rank}): {text}. The group is "
            "unusable from now on. Every rank of a group must call the same collectives, in the same order, "
            "with the same dtype, count, root and op.", group=group, expect=expect)

    def settled(self, error: CollectiveMismatchError, members: Iterable[int],
                deadline: float | None) -> CollectiveMismatchError:
        """``error`` as the op raises it: the first time for its group, wait until the call
        of every live rank of ``members`` (the group's) is known (at most MISMATCH_SETTLE_S,
        and not past ``deadline``), then name them all.  Only in the thread that raises."""
        group = error.group
        if group is None:
            return error
        with self._calls_cv:
            if group not in self._settled:
                wanted = frozenset(members)
                until = time.monotonic() + MISMATCH_SETTLE_S
                until = until if deadline is None else min(until, deadline)
                self._calls_cv.wait_for(
                    lambda: wanted <= self.calls.get(group, {}).keys() | self.dead.keys() | self.left,
                    timeout=max(0.0, until - time.monotonic()))
                self._settled.add(group)
        return self.mismatch_error(group, error.expect)

    # A frame of another call may never *match* a receive (its tag can differ), so the
    # fingerprints are also compared whenever a collective frame is stashed or a collective
    # receive is posted.  Conflicting: the same op number with another fingerprint, or a
    # frame of an op this rank has already finished (it will never be consumed).
    def _check_stash_against(self, handle: Handle) -> None:
        seq, fp = handle.expect
        gave_up = self.abandoned.get(handle.group, (-1,))[0]
        a = self._matcher.find_unexpected(
            lambda a: a.header.kind == Kind.COLL and a.header.group == handle.group and a.header.seq != gave_up
            and (a.header.seq < seq or (a.header.seq == seq and a.header.fingerprint != fp)))
        if a is not None:
            self.group_mismatch(handle.group, a.peer, a.header.seq, a.header.fingerprint, self.rank)

    def finished(self, group: int, seq: int, fingerprint: int = 0) -> None:
        """The engine finished collective ``seq`` (``fingerprint``) of ``group``: a frame of
        it or of an earlier op that arrives from now on was never meant for this rank."""
        self.finished_seq[group] = seq
        self.finished_call[group] = (seq, fingerprint)

    def elsewhere(self, group: int, seq: int, fingerprint: int) -> None:
        """Op ``seq`` of ``group`` runs on other groups (a hierarchy's phases): ``finished``
        from its start, and a frame of it (or earlier) already stashed is a mismatch."""
        self.finished(group, seq, fingerprint)
        if self._matcher.stashes():
            gave_up = self.abandoned.get(group, (-1,))[0]
            a = self._matcher.find_unexpected(lambda a: a.header.kind == Kind.COLL and a.header.group == group
                                              and a.header.seq <= seq and a.header.seq != gave_up)
            if a is not None:
                self.group_mismatch(group, a.peer, a.header.seq, a.header.fingerprint, self.rank)

    def stashed(self, source: int, header: Header) -> None:
        """Transports call this when a frame found no posted receive and was stashed."""
        if header.kind != Kind.COLL:
            return
        if header.seq == self.abandoned.get(header.group, (-1,))[0]:  # (a late frame of an abandoned op)
            self._matcher.discard_where(lambda a: a.header is header)
            return
        if header.seq <= self.finished_seq.get(header.group, -1):
            self.group_mismatch(header.group, source, header.seq, header.fingerprint, self.rank)
            return
        h = self._matcher.find_posted(
            lambda h: h.group == header.group and h.expect is not None
            and (h.expect[0] > header.seq or (h.expect[0] == header.seq and h.expect[1] != header.fingerprint)))
        if h is not None:
            self.group_mismatch(header.group, source, header.seq, header.fingerprint, self.rank)

    def _notify(self, ranks: list[int], frame: bytes) -> None:
        """Send a payload-less control frame to ``ranks`` (best effort, never blocks long)."""
        raise NotImplementedError

    def _fail_sends(self, pred: Callable[[Handle], bool], error_for: Callable[[Handle], BaseException]) -> None:
        """Fail queued sends matching ``pred`` (transports with send queues override)."""

    def flush(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for queued frames (notices included) to leave (queues override)."""

    def close(self) -> None:
        """Leave cleanly: tell peers, stop threads, fail whatever is still pending."""
        with self._state_lock:
            if self.closed_reason is not None:
                return
            self.closed_reason = "destroy_process_group was called"
        self._matcher.fail_where(lambda h: True, lambda h: AbortedError(
            "the process group was destroyed while this receive was pending"))
        self.sends.fail_where(lambda h: True, lambda h: AbortedError(
            "the process group was destroyed while this send waited for its receive"))
