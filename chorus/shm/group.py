"""``ShmGroup``: one process group's shared-memory window and the collectives run over it.

A ProcessGroup whose members all share a host gets ``pg.shm`` (created by
chorus.shm.handshake when the group is created) and ``chorus.api.launch.run`` sends its
collectives here.  The window is created once and reused by every op; ops of one group
run one at a time (the group's queue), and each op's state is its own range of syncs and
the parities they select — no two ops share a control area (sglang's hangs came from
collectives sharing one).

If an op fails half-way on this rank (timeout, Ctrl-C, a peer's death), the window is out
of step with the other ranks: this rank marks the op abandoned in its control line (the
others then stop waiting and raise) and every later op of the group raises AbortedError.
"""

from __future__ import annotations

import threading

from chorus.errors import AbortedError, CollectiveMismatchError
from chorus.host.segment import Segment
from chorus.shm import collectives as algo
from chorus.shm import mapped, registered
from chorus.shm.cma import address
from chorus.shm.phases import Crew, Reduce, part_of
from chorus.shm.sync import TCP, Backoff, Sync, Waker
from chorus.shm.window import Layout, Settings, Window


class Planned:
    """What an all_reduce of one (dtype, shape, op) needs on the latency path, built once
    per group, indexed by the parity ``p`` of the op's first phase:

    one-shot (``part`` None): ``mine[p]``, this rank's slot shaped like the arrays, and
    ``into[p](out)``, which reduces every rank's slot into ``out``;

    reduce-scatter + all-gather in one chunk (chorus.shm.collectives.two_shot): also
    ``part[p]``, this rank's slice of the result slot of parity ``p ^ 1``, into which
    ``into[p]`` reduces slice ``me`` of every rank's slot, and ``result[p]``, that whole
    result slot shaped like the arrays;

    and the op's fingerprint, and whether the result is then divided by W (AVG).

    ``offer``: the arrays are of a size at which ranks may offer registered buffers
    (chorus.shm.mapped.use), so the op offers none, and steps aside to the general path
    for a registered array; ``reduce``: the op's row reducer for those paths."""

    __slots__ = ("mine", "into", "part", "result", "fingerprint", "average", "offer", "reduce")

    def __init__(self, mine: tuple, into: tuple, fingerprint: int, average: bool,
                 part: tuple | None = None, result: tuple | None = None, offer: bool = False, reduce=None):
        self.mine = mine
        self.into = into
        self.part = part
        self.result = result
        self.fingerprint = fingerprint
        self.average = average
        self.offer = offer
        self.reduce = reduce


class ShmGroup:
    """The window of one group, mapped by this rank (group rank ``rank``); ``settings``:
    the group's (chorus.shm.window.Settings; default: this process's now)."""

    def __init__(self, segment: Segment, layout: Layout, rank: int, members: tuple[int, ...],
                 transport, group: int, backoff: Backoff, threads: int = 1, settings: Settings | None = None):
        self.segment = segment
        self.transport = transport
        self.group = group
        self.window = Window(segment.buf, layout, rank, settings)
        if threads > 1:
            self.window.crew = Crew(threads)
        self.sync = Sync(self.window.control, rank, members, transport, group, backoff,
                         Waker.make(segment.buf, layout.world, rank), self.window.arrivals,
                         transport.wait_reports.get(group))
        self.broken: str | None = None
        self.closed = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"ShmGroup(group={self.group}, world={self.window.world}, slot={self.window.slot}, "
                f"threads={1 if self.window.crew is None else self.window.crew.threads})")

    def announce_tcp(self, ctx) -> None:
        """This rank runs op ``ctx`` over TCP (lets shared-memory waiters name a rank that
        chose another path)."""
        self.sync.announce(ctx.seq, ctx.fingerprint, TCP)

    def run(self, name: str, ctx, buffers: dict, reduce=None, root: int = -1,
            args: dict | None = None) -> None:
        """Run collective ``name`` (a chorus.api collective's name and buffers) for op ``ctx``."""
        self._run(ctx, _OPS[name], ctx, buffers, reduce, root, args, self.window)

    def all_reduce_plan(self, dtype, shape: tuple, bind, fingerprint: int, average: bool,
                        reduce: Reduce) -> Planned | None:
        """A :class:`Planned` for all_reduce of arrays of ``dtype`` and ``shape``, or None
        when the general path must run them (chorus.shm.collectives: neither one-shot nor
        ``two_shot``).  ``bind(rows)`` makes ``into`` for a (W, ...) stack of slots (the API
        layer's reduction, chorus.reductions.rows_into); ``reduce`` is that reduction's
        row reducer (chorus.reductions.row_reducer)."""
        win = self.window
        count = 1
        for n in shape:
            count *= n
        if algo.one_shot(win, dtype, count):
            mine, stacks = win.small(dtype, count)
            return Planned(tuple(m.reshape(shape) for m in mine),
                           tuple(bind(s.reshape((win.world, *shape))) for s in stacks), fingerprint, average)
        if not algo.two_shot(win, dtype, count):
            return None
        a, b = part_of(count, win.rank, win.world)  # the general path's reduce_slice, in one part
        return Planned(tuple(win.slot_of(p, win.rank, dtype, 0, count).reshape(shape) for p in (0, 1)),
                       tuple(bind(win.stack(p, dtype, a, b - a)) for p in (0, 1)), fingerprint, average,
                       part=tuple(win.result(p ^ 1, dtype, a, b - a) for p in (0, 1)),
                       result=tuple(win.result(p ^ 1, dtype, 0, count).reshape(shape) for p in (0, 1)),
                       offer=mapped.use(win, count * dtype.itemsize), reduce=reduce)

    def all_to_all_plan(self, dtype, count: int, fingerprint: int) -> Exchange | None:
        """An :class:`Exchange` for all_to_all of ``count`` elements of ``dtype`` per rank in
        equal blocks, or None when that is not one round of the copy path."""
        block = algo.all_to_all_in_one_round(self.window, dtype, count)
        if not block:
            return None
        return Exchange(*self.window.exchange(dtype, block), block, fingerprint)

    def all_to_all_fast(self, pg, seq: int, plan: Exchange, inp, out) -> None:
        """all_to_all of ``inp`` into ``out`` (C-contiguous, apart, ``out`` writable, the
        plan's dtype and size) as op ``seq`` of ``pg``: the latency path of equal blocks
        that fit one round.  Phase 0 is chorus.shm.collectives.all_to_all's with the views
        built once (the same words published, so that ranks on either path agree); after
        the first sync, when every rank declared this block size, one copy out::

            rank r:  slot[r].piece[q] <- inp[block q]     for every q   (parity p)
            sync     (checks every rank called the same op)
            rank r:  out[block q] <- slot[q].piece[r]     for every q

        Otherwise the general path's rest (``all_to_all_rest``) checks the counts and
        raises, or goes on, as it would have.  ``_run``'s frame is inlined, as in
        ``all_reduce_planned``, so that the op's context is built only to wait or raise
        (through ``_run`` a 4 KiB all_to_all of 2 ranks took 21.1-21.5 us instead of
        16.9-17.1: ``chorus bench --collective all_to_all --world 2 -b 4K -e 4K``)."""
        t, win = self.transport, self.window
        if t.dead or t.mismatched or t.closed_reason is not None:
            self._check_transport(pg.context("all_to_all", seq, plan.fingerprint))
        lock = self._lock
        lock.acquire()
        try:
            if self.broken is not None:
                raise AbortedError(f"{pg.context('all_to_all', seq, plan.fingerprint).describe()}: {self.broken}")
            sync, ctx = self.sync, None
            p = sync.count & 1
            try:
                sync.begin(seq, plan.fingerprint)
                if win.cma is not None:
                    win.publish(address(inp))
                if win.maps is not None:
                    win.publish_mapped(p, None)
                win.declare_common(p, plan.block)
                mine = plan.pieces[p]
                mine[...] = inp.reshape(mine.shape)
                if not sync.arrive_first(seq, plan.fingerprint):
                    ctx = pg.context("all_to_all", seq, plan.fingerprint)
                    sync.settle_first(ctx)
                if win.common_count(p) == plan.block:
                    theirs = plan.blocks[p]
                    out.reshape(theirs.shape)[...] = theirs
                else:
                    ctx = ctx or pg.context("all_to_all", seq, plan.fingerprint)
                    counts = [plan.block] * win.world
                    algo.all_to_all_rest(win, sync, ctx, inp.reshape(-1), out.reshape(-1), counts, counts, p)  # flat, as the general path's
            except algo.CountsDisagree:
                raise  # raised by every rank at the same sync: still in step
            except BaseException as exc:
                error = self._failed(ctx or pg.context("all_to_all", seq, plan.fingerprint), exc)
                if error is exc:
                    raise
                raise error from None
        finally:
            lock.release()
        t.finished_seq[self.group] = seq

    def all_reduce_planned(self, pg, seq: int, plan: Planned, data) -> None:
        """all_reduce of ``data`` (C-contiguous, writable, the plan's dtype and shape) as op
        ``seq`` of ``pg`` (its sequence number taken already): the latency path.  The same
        algorithms, syncs and bits as chorus.shm.collectives.all_reduce's one-shot branch
        and its reduce-scatter + all-gather in one chunk, with nothing built per call:
        ``pg.context(...)`` makes the op's context only to wait or to raise::

            rank r:      slot[r] <- data                      (parity p)
            sync         (checks every rank called the same op)
            one-shot:    data <- reduce(slot[0], ..., slot[W-1])
            else:        result[slice r] <- reduce(slot[0..W-1][slice r])   (parity p ^ 1)
                         sync
                         data <- result

        At sizes where ranks may offer registered buffers (``plan.offer``), a registered
        ``data`` takes the general path (which offers it), and an unregistered one offers
        none in phase 0; if another rank offered one, the op goes on as the general path
        does (chorus.shm.collectives.all_reduce_offered).
        """
        if plan.offer and registered.find(data) is not None:
            self.run("all_reduce", _context(pg, seq, plan), {"data": data.reshape(-1)}, plan.reduce)
            return
        t = self.transport
        if t.dead or t.mismatched or t.closed_reason is not None:
            self._check_transport(_context(pg, seq, plan))
        lock = self._lock  # as in _run, which this is with the op inlined (acquire/release:
        lock.acquire()     # a third of a with-statement's cost)
        try:
            if self.broken is not None:
                raise AbortedError(f"{_context(pg, seq, plan).describe()}: {self.broken}")
            sync = self.sync
            p = sync.count & 1
            try:
                sync.begin(seq, plan.fingerprint)
                if plan.offer:
                    self.window.publish_mapped(p, None)
                plan.mine[p][...] = data
                if not sync.arrive_first(seq, plan.fingerprint):
                    sync.settle_first(_context(pg, seq, plan))
                part = plan.part
                if plan.offer and self.window.offered(p):
                    algo.all_reduce_offered(self.window, sync, _context(pg, seq, plan), data.reshape(-1), plan.reduce)
                elif part is None:
                    plan.into[p](data)
                else:
                    plan.into[p](part[p])
                    if not sync.arrive_next():
                        sync.settle(_context(pg, seq, plan))
                    data[...] = plan.result[p]
            except BaseException as exc:
                error = self._failed(_context(pg, seq, plan), exc)
                if error is exc:
                    raise
                raise error from None
        finally:
            lock.release()
        t.finished_seq[self.group] = seq

    def _run(self, ctx, op, *args) -> None:
        """``op(sync, *args)`` as op ``ctx`` of this group: one op at a time; an op that
        fails half-way leaves the group unusable (and tells the others)."""
        t = self.transport
        if t.dead or t.mismatched or t.closed_reason is not None:
            self._check_transport(ctx)
        with self._lock:  # two threads issuing ops on one group at once: one after the other
            if self.broken is not None:
                raise AbortedError(f"{ctx.describe()}: {self.broken}")
            sync = self.sync
            try:
                sync.begin(ctx.seq, ctx.fingerprint)
                op(sync, *args)
            except algo.CountsDisagree:
                raise  # raised by every rank at the same sync: still in step
            except BaseException as exc:
                error = self._failed(ctx, exc)
                if error is exc:
                    raise
                raise error from None
        t.finished_seq[self.group] = ctx.seq  # t.finished(), inlined

    def _failed(self, ctx, exc: BaseException) -> BaseException:
        """Op ``ctx`` failed half-way with ``exc``: mark the group unusable and tell the
        others; return what the caller raises (a destroyed group raises AbortedError; a
        collective mismatch, once every member's call is known: Transport.settled)."""
        if self.closed:
            raise AbortedError(f"{ctx.describe()}: the group was destroyed while the op was running") from None
        self.broken = (f"an earlier op (seq {ctx.seq}) failed half-way ({type(exc).__name__}); "
                       "the group's shared-memory window is out of step and the group is "
                       "unusable: create a new group")
        self.sync.abandon(ctx.seq)
        if isinstance(exc, CollectiveMismatchError):
            return self.transport.settled(exc, self.sync.members, ctx.deadline)
        return exc

    def _check_transport(self, ctx) -> None:
        error = self.sync.transport_error(ctx)  # (a lost member's error names the op, as a wait's does)
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop using the window (destroy_process_group) and unmap it once no view of it is
        left (an op still running on another thread fails with AbortedError)."""
        self.closed = True
        self.broken = "the group was destroyed"
        if self.window.crew is not None:
            self.window.crew.close()
        if self.window.maps is not None:
            self.window.maps.close()
        self.sync.release()
        self.window.release()
        if self.sync.waker is not None:
            self.sync.waker.release()
        self.segment.close()


class Exchange:
    """What an all_to_all in one round of one (dtype, size) needs, built once per group:
    per parity, this rank's slot cut into W pieces and the stack of the pieces meant for
    this rank (chorus.shm.window.Window.exchange); the block size and the fingerprint."""

    __slots__ = ("pieces", "blocks", "block", "fingerprint")

    def __init__(self, pieces: tuple, blocks: tuple, block: int, fingerprint: int):
        self.pieces = pieces
        self.blocks = blocks
        self.block = block
        self.fingerprint = fingerprint


def _context(pg, seq: int, plan: Planned):
    """The context of planned all_reduce ``seq`` (the latency path's slow paths only)."""
    return pg.context("all_reduce", seq, plan.fingerprint)


_OPS = {
    "barrier": lambda s, ctx, b, red, root, a, w: algo.barrier(w, s, ctx),
    "all_reduce": lambda s, ctx, b, red, root, a, w: algo.all_reduce(w, s, ctx, b["data"], red),
    "reduce": lambda s, ctx, b, red, root, a, w: algo.all_reduce(w, s, ctx, b["data"], red, root),
    "broadcast": lambda s, ctx, b, red, root, a, w: algo.broadcast(w, s, ctx, b["data"], root),
    "all_gather": lambda s, ctx, b, red, root, a, w: algo.all_gather(w, s, ctx, b["input"], b["output"]),
    "gather": lambda s, ctx, b, red, root, a, w: algo.all_gather(w, s, ctx, b["input"], b.get("output")),
    "scatter": lambda s, ctx, b, red, root, a, w: algo.scatter(w, s, ctx, b.get("input"), b["output"], root),
    "reduce_scatter": lambda s, ctx, b, red, root, a, w: algo.reduce_scatter(
        w, s, ctx, b["input"], b["output"], a["counts"], red),
    "all_to_all": lambda s, ctx, b, red, root, a, w: algo.all_to_all(
        w, s, ctx, b["input"], b["output"], a["send_counts"], a["recv_counts"]),
}
