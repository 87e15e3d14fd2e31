"""The collectives over a group's shared-memory window: written once, read many.

Each collective is a few stages run in pipelined phases over chunks of the message
(chorus.shm.phases: how phases, parities, chunks and helper-thread parts work), or, for
large messages where it measured faster, a single-copy op that reads the peers' buffers
directly (chorus.shm.direct).

Names below: ``W`` ranks, ``me`` this rank's group rank, ``slot[r]`` rank r's data slot of
the parity at hand, ``result`` the shared result slot; ``rank q's x`` is rank q's own
buffer ``x``, read or written with chorus.shm.cma.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from chorus import recorder
from chorus.errors import BufferMismatchError
from chorus.shm import cma, direct, mapped, registered
from chorus.shm.phases import (
    Reduce,
    Stage,
    chunks,
    offsets,
    part_of,
    parts_for,
    pipeline,
    recorded,
    rows_part,
    span,
    sub,
    to_my_slot,
)
from chorus.shm.sync import Sync
from chorus.shm.window import Window

#: In groups of at most this many ranks, larger all_reduces run one-shot chunk by chunk
#: (each rank reduces every chunk whole) instead of reduce-scatter + all-gather.  Not a
#: setting: above 2 the whole chunks' rows could take another numpy method than single
#: copy's slices (chorus.reductions.row_reducer), and bits would depend on the path; at 2
#: every element is one ufunc call on two values.  (The paired probe that changed it to
#: time it: ``git show 5907f47^:bench/ab_probe.py``.)
WHOLE_CHUNKS_WORLD = 2


def one_shot(win: Window, dtype: np.dtype, count: int, op: str = "all_reduce") -> bool:
    """Whether all_reduce (``op``: or reduce) of ``count`` elements of ``dtype`` runs
    one-shot (every rank reduces everything): it fits a slot, and each rank reads at most
    ``CHORUS_SHM_ONESHOT_BYTES`` of the others' data (nbytes x (W - 1)): against the cached
    two-shot plan, one-shot lost from 16 KiB at W = 8 (19.3-19.9 us against 24.5-31.1) and
    from 32 KiB at W = 4 (21.7-27.0 against 23.7-30.3), 32 vCPUs, 64 KiB against 256 KiB
    alternating in one job (docs/results/32-vcpu-h200-host/oneshot-ab/), or the group has at most
    ``WHOLE_CHUNKS_WORLD`` ranks and the op does not copy once (``direct.use``): then
    one-shot is the whole-chunk algorithm with one chunk (and takes the latency path of
    chorus.api.collectives: at 1 MiB, W = 2, 210-235 us against 265-375 us through the
    general path, which offers registered buffers)."""
    if count > win.capacity(dtype):
        return False
    nbytes = count * dtype.itemsize
    return nbytes * (win.world - 1) <= win.settings.oneshot_bytes or (
        win.world <= WHOLE_CHUNKS_WORLD and not direct.use(win, op, nbytes))


def two_shot(win: Window, dtype: np.dtype, count: int) -> bool:
    """Whether all_reduce of ``count`` elements of ``dtype`` may run reduce-scatter +
    all-gather in one chunk with one part per phase (three phases, two syncs; see
    ``all_reduce``): not one-shot, it fits a slot, the group has more than
    ``WHOLE_CHUNKS_WORLD`` ranks, and neither single copy nor helper threads take it.
    The latency path runs these from a cached plan (chorus.shm.group.Planned).  At sizes
    where ranks may offer registered buffers (``mapped.use``) it does so only for an
    unregistered buffer, offering none, and goes on with ``all_reduce_offered`` when
    another rank offered one."""
    nbytes = count * dtype.itemsize
    return (win.world > WHOLE_CHUNKS_WORLD and 0 < count <= win.capacity(dtype)
            and not one_shot(win, dtype, count) and not direct.use(win, "all_reduce", nbytes)
            and parts_for(win, nbytes, nbytes) == 1)


def barrier(win: Window, sync: Sync, ctx) -> None:
    """Every rank raises its counter; every rank waits for all the others."""
    sync.sync(ctx, first=True)


def all_reduce(win: Window, sync: Sync, ctx, data: np.ndarray, reduce: Reduce, root: int = -1) -> None:
    """``data`` <- op over every rank's ``data`` (``root >= 0``: only rank ``root`` gets it: reduce).

    One-shot, for small messages (one sync; see ``one_shot``)::

        phase 0   rank r:      slot[r] <- data
        phase 1   every rank:  data <- reduce(slot[0], slot[1], ..., slot[W-1])

    Large messages in groups of at most ``WHOLE_CHUNKS_WORLD`` ranks: one-shot chunk by
    chunk (each rank reads W - 1 chunks per chunk of its own, and copies nothing out)::

        phase k     rank r:      slot[r] <- data[chunk k]
        phase k+1   every rank:  data[chunk k] <- reduce(slot[0..W-1])

    Larger groups: reduce-scatter + all-gather over the slices of each chunk::

        phase k     rank r:  slot[r] <- data[chunk k]
        phase k+1   rank r:  result[slice r] <- reduce(slot[0..W-1][slice r])
        phase k+2   rank r:  data[chunk k] <- result             (all W slices)

    Every rank computes the same numpy reduction of the same rows, so results are
    bit-identical on every rank.  From ``direct.cma_bytes``: single copy
    (``direct.all_reduce``).  From ``CHORUS_SHM_MAPPED_BYTES`` (``mapped.use``), phase 0
    also offers this rank's registered buffer, if it has one, and when every rank did, the
    op continues on the mapped buffers (``mapped.all_reduce``); else on the path it would
    have taken.
    """
    me, dt, count = win.rank, data.dtype, data.size
    readers = root < 0 or me == root
    size = win.capacity(dt)
    name = "all_reduce" if root < 0 else "reduce"
    if one_shot(win, dt, count, name):
        mine, stacks = win.small(dt, count)  # the fast path: cached views
        p = sync.parity
        if recorder.current is not None:
            _one_shot_recorded(sync, ctx, mine[p], stacks[p], data, reduce, readers)
            return
        mine[p][...] = data
        sync.sync(ctx, first=True)
        if readers:
            reduce(stacks[p], data)
        return
    single = direct.use(win, name, data.nbytes)
    offer = mapped.use(win, data.nbytes)
    if single and not offer:
        direct.all_reduce(win, sync, ctx, data, reduce, root)
        return

    start = 0
    if offer:  # phase 0 of every candidate path, then the path every rank can take
        p = sync.parity
        mine = registered.find(data)
        win.publish_mapped(p, mine)
        if not single and mine is None:  # (a rank that offers a buffer copies nothing yet)
            copy_in = to_my_slot(win, data, size)
            (copy_in if recorder.current is None else recorded(copy_in, ctx))(0, p, 0, 1)
        sources = direct.open_op(win, sync, ctx, data if single else None)
        where = win.mapped(p)
        if where is not None or single:
            _in_place(sync, ctx, where, lambda: mapped.all_reduce(win, ctx, data, reduce, root, where),
                      lambda: direct.reduce_everywhere(win, ctx, data, reduce, root, sources))
            return
        start = 0 if win.offered(p) else 1  # some rank skipped phase 0's copy: every rank runs it again
    _copy_path(win, sync, ctx, data, reduce, root, start, offer)


def all_reduce_offered(win: Window, sync: Sync, ctx, data: np.ndarray, reduce: Reduce) -> None:
    """The rest of an all_reduce that began on the latency path (chorus.shm.group:
    ``data`` copied into this rank's slot, no buffer offered, the first sync passed) after
    another rank offered a registered buffer: that rank skipped phase 0's copy, so every
    rank runs the copy path from phase 0 again, as ``all_reduce`` does."""
    _copy_path(win, sync, ctx, data, reduce, -1, 0, True)


def _copy_path(win: Window, sync: Sync, ctx, data: np.ndarray, reduce: Reduce, root: int, start: int,
               began: bool) -> None:
    """all_reduce's copy path through the window, from phase ``start`` (``began``: the op
    had its first sync already)."""
    me, dt, count = win.rank, data.dtype, data.size
    readers = root < 0 or me == root
    size = win.capacity(dt)
    copy_in = to_my_slot(win, data, size)
    parts = parts_for(win, min(count, size) * dt.itemsize, data.nbytes)
    if win.world <= WHOLE_CHUNKS_WORLD:

        def reduce_chunk(j: int, p: int, part: int, parts: int) -> int:
            lo, hi = span(j, size, count)
            a, b = rows_part(0, hi - lo, dt.itemsize, part, parts)
            if not readers:
                return 0
            reduce(win.stack(p ^ 1, dt, a, b - a), data[lo + a: lo + b])
            return win.world * (b - a) * dt.itemsize

        pipeline(sync, ctx, chunks(count, size), (copy_in, reduce_chunk), start, win, parts, began=began)
        return

    def reduce_slice(j: int, p: int, part: int, parts: int) -> int:
        lo, hi = span(j, size, count)
        a, b = rows_part(*part_of(hi - lo, me, win.world), dt.itemsize, part, parts)
        reduce(win.stack(p ^ 1, dt, a, b - a), win.result(p, dt, a, b - a))
        return win.world * (b - a) * dt.itemsize

    def copy_out(j: int, p: int, part: int, parts: int) -> int:
        lo, hi = span(j, size, count)
        a, b = sub(0, hi - lo, part, parts)
        if not readers:
            return 0
        data[lo + a: lo + b] = win.result(p ^ 1, dt, a, b - a)
        return (b - a) * dt.itemsize

    pipeline(sync, ctx, chunks(count, size), (copy_in, reduce_slice, copy_out), start, win, parts, began=began)


def broadcast(win: Window, sync: Sync, ctx, data: np.ndarray, root: int) -> None:
    """``data`` of rank ``root`` -> ``data`` of every rank, through the whole data area::

        phase k     root:        area <- data[chunk k]
        phase k+1   other ranks: data[chunk k] <- area

    (No single copy: W - 1 readers pinning the root's pages at once never beat the
    window, whose pages stay in cache; chorus.shm.direct.MEASURED.)
    """
    me, dt, count = win.rank, data.dtype, data.size
    size = win.world * win.capacity(dt)

    def copy_in(j: int, p: int, part: int, parts: int) -> int:
        if me != root:
            return 0
        lo, hi = span(j, size, count)
        a, b = sub(lo, hi, part, parts)
        win.region(p, dt, a - lo, b - a)[...] = data[a:b]
        return (b - a) * dt.itemsize

    def copy_out(j: int, p: int, part: int, parts: int) -> int:
        if me == root:
            return 0
        lo, hi = span(j, size, count)
        a, b = sub(lo, hi, part, parts)
        data[a:b] = win.region(p ^ 1, dt, a - lo, b - a)
        return (b - a) * dt.itemsize

    pipeline(sync, ctx, chunks(count, size), (copy_in, copy_out), win=win,
             parts=parts_for(win, min(count, size) * dt.itemsize, message=data.nbytes))


def all_gather(win: Window, sync: Sync, ctx, inp: np.ndarray, out: np.ndarray | None) -> None:
    """Block r of ``out`` <- rank r's ``inp`` (``out`` None: this rank gathers nothing)::

        phase k     rank r:          slot[r] <- inp[chunk k]
        phase k+1   ranks with out:  out[r][chunk k] <- slot[r]      for every r, one copy

    Single copy (from ``direct.cma_bytes`` of output; ``inp`` may be this rank's
    block of ``out``)::

        phase 1     ranks with out:  out[q] <- rank q's inp          for every q
        sync        nobody returns while others read its inp
    """
    me, dt, count = win.rank, inp.dtype, inp.size
    size = win.capacity(dt)
    blocks = None if out is None else out.reshape(win.world, count)
    if direct.use(win, "all_gather", win.world * inp.nbytes):
        sources = direct.open_op(win, sync, ctx, inp)
        with direct.closing(sync, ctx):
            if blocks is not None:
                def read_block(q: int, part: int, parts: int) -> None:
                    a, b = part_of(count, part, parts)
                    direct.read_from(win, ctx, q, blocks[q, a:b], sources[q] + a * dt.itemsize)

                direct.from_peers(win, read_block, win.world * inp.nbytes,
                                  lambda: direct.copy_unless_same(blocks[me], inp))
        return

    copy_in = to_my_slot(win, inp, size)

    def copy_out(j: int, p: int, part: int, parts: int) -> int:
        if blocks is None:
            return 0
        lo, hi = span(j, size, count)
        a, b = sub(0, hi - lo, part, parts)
        blocks[:, lo + a: lo + b] = win.stack(p ^ 1, dt, a, b - a)
        return win.world * (b - a) * dt.itemsize

    pipeline(sync, ctx, chunks(count, size), (copy_in, copy_out), win=win,
             parts=parts_for(win, win.world * min(count, size) * dt.itemsize,
                          message=win.world * inp.nbytes))


def scatter(win: Window, sync: Sync, ctx, inp: np.ndarray | None, out: np.ndarray, root: int) -> None:
    """Block r of rank ``root``'s ``inp`` -> rank r's ``out``::

        phase k     root:    slot[r] <- inp[r][chunk k]   for every r, one copy
        phase k+1   rank r:  out[chunk k] <- slot[r]

    Single copy (from ``direct.cma_bytes`` of the root's input)::

        phase 1     rank r:  out <- rank root's inp[r]
        sync        the root returns only when every rank has read its inp
    """
    me, dt, count = win.rank, out.dtype, out.size
    size = win.capacity(dt)
    if direct.use(win, "scatter", win.world * out.nbytes):
        sources = direct.open_op(win, sync, ctx, inp if me == root else None)
        with direct.closing(sync, ctx):
            if me == root:
                out[...] = inp[me * count: (me + 1) * count]
            else:
                direct.read_from(win, ctx, root, out, sources[root] + me * out.nbytes)
        return

    def copy_in(j: int, p: int, part: int, parts: int) -> int:
        if me != root:
            return 0
        lo, hi = span(j, size, count)
        a, b = sub(0, hi - lo, part, parts)
        win.stack(p, dt, a, b - a)[...] = inp.reshape(win.world, count)[:, lo + a: lo + b]
        return win.world * (b - a) * dt.itemsize

    def copy_out(j: int, p: int, part: int, parts: int) -> int:
        lo, hi = span(j, size, count)
        a, b = sub(0, hi - lo, part, parts)
        out[lo + a: lo + b] = win.slot_of(p ^ 1, me, dt, a, b - a)
        return (b - a) * dt.itemsize

    pipeline(sync, ctx, chunks(count, size), (copy_in, copy_out), win=win,
             parts=parts_for(win, min(count, size) * dt.itemsize, message=win.world * out.nbytes))


def reduce_scatter(win: Window, sync: Sync, ctx, inp: np.ndarray, out: np.ndarray,
                   counts: Sequence[int], reduce: Reduce) -> None:
    """Block r of ``inp`` (``counts[r]`` elements), reduced over every rank -> rank r's ``out``.

    Each slot is cut into W pieces, piece q for block q (round k carries the k-th
    ``piece``-sized part of every block)::

        phase k     rank r:  slot[r].piece[q] <- inp[block q][round k]   for every q
        phase k+1   rank r:  out[round k] <- reduce(slot[0..W-1].piece[r])

    (No single copy: it was within 10% of this either way; chorus.shm.direct.MEASURED.)
    """
    me, w, dt = win.rank, win.world, out.dtype
    piece = win.capacity(dt) // w
    copy_in = _to_my_pieces(win, inp, counts, len(set(counts)) <= 1)
    mine = counts[me]

    def reduce_mine(j: int, p: int, part: int, parts: int) -> int:
        lo, hi = span(j, piece, mine)
        a, b = rows_part(0, hi - lo, dt.itemsize, part, parts)
        reduce(win.stack(p ^ 1, dt, me * piece + a, b - a), out[lo + a: lo + b])
        return w * (b - a) * dt.itemsize

    rows = min(piece, max(counts, default=0))
    pipeline(sync, ctx, chunks(max(counts, default=0), piece), (copy_in, reduce_mine), win=win,
             parts=parts_for(win, w * rows * dt.itemsize, inp.nbytes))


def all_to_all(win: Window, sync: Sync, ctx, inp: np.ndarray, out: np.ndarray,
               send_counts: Sequence[int], recv_counts: Sequence[int]) -> None:
    """Rank r's block q of ``inp`` -> rank q's block r of ``out``; blocks may differ in size.

    Each slot is cut into W pieces, piece q for rank q; the first phase also publishes
    every rank's send and receive counts, so that all ranks agree on the number of rounds
    and a send/receive size disagreement is reported on every rank::

        phase k     rank r:  slot[r].piece[q] <- inp[block q][round k]    for every q
        phase k+1   rank q:  out[block r][round k] <- slot[r].piece[q]    for every r

    Registered inputs (chorus.shm.mapped), when every rank offered one in phase 0 (a rank
    offers its input when it sends enough, ``mapped.use``): as single copy below,
    with the peers' inputs mapped (``mapped.all_to_all``).

    Single copy, when some rank sends ``direct.cma_bytes`` or more (known to all after the
    first sync, from the counts; a rank that sends less also fills round 0 of the copy
    path, in case no rank does)::

        phase 0     rank r:  publish inp's address, its counts     (ranks that send little:
                                                                    also round 0 as above,
                                                                    unless they offer a
                                                                    registered input)
        phase 1     rank q:  out[block r] <- rank r's inp[block q]  for every r
        sync        nobody returns while others read its inp

    ``inp`` and ``out`` may be one buffer: then ``inp`` is copied first (others read it
    while this rank writes ``out``).
    """
    p = sync.parity
    uniform = win.declare_counts(p, send_counts, recv_counts)  # one count to and from every rank
    if win.cma is not None:
        if np.may_share_memory(inp, out):
            inp = inp.copy()
        win.publish(cma.address(inp))
    copy_in = _to_my_pieces(win, inp, send_counts, uniform)
    my_bytes = sum(send_counts) * out.itemsize
    mine = registered.find(inp) if mapped.use(win, my_bytes, "all_to_all") else None
    if win.maps is not None:
        win.publish_mapped(p, mine)
    if mine is None and not direct.use(win, "all_to_all", my_bytes):
        (copy_in if recorder.current is None else recorded(copy_in, ctx))(0, p, 0, 1)
    sync.sync(ctx, first=True)
    all_to_all_rest(win, sync, ctx, inp, out, send_counts, recv_counts, p)


def all_to_all_in_one_round(win: Window, dtype: np.dtype, count: int) -> int:
    """The block size when all_to_all of ``count`` elements per rank, in W equal blocks,
    takes the copy path in one round (the latency path's case: chorus.shm.group.ShmGroup.
    all_to_all_fast); 0 otherwise."""
    w = win.world
    if count <= 0 or count % w:
        return 0
    nbytes = count * dtype.itemsize
    if count // w > win.capacity(dtype) // w or direct.use(win, "all_to_all", nbytes) or \
            mapped.use(win, nbytes, "all_to_all"):
        return 0
    return count // w


def all_to_all_rest(win: Window, sync: Sync, ctx, inp: np.ndarray, out: np.ndarray,
                    send_counts: Sequence[int], recv_counts: Sequence[int], p: int) -> None:
    """all_to_all after its first sync (which ended phase 0, of parity ``p``): check the
    counts every rank declared, then read the peers' inputs (mapped or single copy) or run
    the copy path's remaining rounds."""
    w, dt = win.world, out.dtype
    piece = win.capacity(dt) // w
    common = win.common_count(p)  # every rank sends one count everywhere: nothing to check
    if common is None:
        send_table, recv_table = win.counts(p)
        if not np.array_equal(send_table, recv_table.T):
            _counts_disagree(send_table, recv_table, ctx)
        most, largest = int(send_table.max()), int(send_table.sum(axis=1).max())
    else:
        most, largest = common, common * w
    where = win.mapped(p) if mapped.use(win, largest * dt.itemsize, "all_to_all") else None
    if where is not None or direct.use(win, "all_to_all", largest * dt.itemsize):
        table = send_table if common is None else np.full((w, w), common, np.uint64)
        _in_place(sync, ctx, where, lambda: mapped.all_to_all(win, ctx, inp, out, table, recv_counts, where),
                  lambda: direct.all_to_all(win, ctx, inp, out, table, recv_counts))
        return
    uniform = len(set(send_counts) | set(recv_counts)) == 1
    copy_in, copy_out = _all_to_all_stages(win, inp, out, send_counts, recv_counts, uniform)
    parts = parts_for(win, w * min(piece, most) * dt.itemsize, message=inp.nbytes)
    again = win.maps is not None and win.offered(p)  # some rank skipped round 0's copy: all run it again
    pipeline(sync, ctx, chunks(most, piece), (copy_in, copy_out), start=0 if again else 1, win=win, parts=parts,
             began=True)


def _all_to_all_stages(win: Window, inp: np.ndarray, out: np.ndarray, send_counts: Sequence[int],
                       recv_counts: Sequence[int], uniform: bool) -> tuple[Stage, Stage]:
    """The copy path's two stages of all_to_all: (copy_in, copy_out)."""
    me, w, dt = win.rank, win.world, out.dtype
    piece = win.capacity(dt) // w
    recvs = None if uniform else offsets(recv_counts)
    c = send_counts[0]

    def copy_out(j: int, p: int, part: int, parts: int) -> int:
        if uniform:
            lo, hi = span(j, piece, c)
            a, b = sub(0, hi - lo, part, parts)
            out.reshape(w, c)[:, lo + a: lo + b] = win.stack(p ^ 1, dt, me * piece + a, b - a)
            return w * (b - a) * dt.itemsize
        moved = 0
        for r in range(w):
            lo, hi = span(j, piece, recv_counts[r])
            a, b = sub(0, hi - lo, part, parts)
            out[recvs[r] + lo + a: recvs[r] + lo + b] = win.slot_of(p ^ 1, r, dt, me * piece + a, b - a)
            moved += b - a
        return moved * dt.itemsize

    return _to_my_pieces(win, inp, send_counts, uniform), copy_out


def _to_my_pieces(win: Window, inp: np.ndarray, counts: Sequence[int], uniform: bool) -> Stage:
    """The stage that copies round j of every block q of ``inp`` (``counts[q]`` elements,
    one count for all when ``uniform``) into piece q of this rank's slot: the first stage
    of reduce_scatter and of all_to_all."""
    me, w, dt = win.rank, win.world, inp.dtype
    piece = win.capacity(dt) // w
    starts = None if uniform else offsets(counts)

    def copy_in(j: int, p: int, part: int, parts: int) -> int:
        if uniform:
            lo, hi = span(j, piece, counts[0])
            a, b = sub(0, hi - lo, part, parts)
            win.pieces(p, me, dt, piece, hi - lo)[:, a:b] = inp.reshape(w, counts[0])[:, lo + a: lo + b]
            return w * (b - a) * dt.itemsize
        moved = 0
        for q in range(w):
            lo, hi = span(j, piece, counts[q])
            a, b = sub(0, hi - lo, part, parts)
            win.slot_of(p, me, dt, q * piece + a, b - a)[...] = inp[starts[q] + lo + a: starts[q] + lo + b]
            moved += b - a
        return moved * dt.itemsize

    return copy_in


def _one_shot_recorded(sync: Sync, ctx, mine: np.ndarray, stack: np.ndarray, data: np.ndarray, reduce: Reduce,
                       readers: bool) -> None:
    """all_reduce's one-shot branch, reporting its copy and reduction to the recorder
    (its sync reports itself)."""
    start = time.perf_counter()
    mine[...] = data
    recorder.transfer("copy", ctx, "shm", start, data.nbytes, stage="copy_in")
    sync.sync(ctx, first=True)
    if readers:
        start = time.perf_counter()
        reduce(stack, data)
        recorder.transfer("reduce", ctx, "shm", start, stack.nbytes, stage="reduce_all")


def _in_place(sync: Sync, ctx, where, on_mapped, on_direct) -> None:
    """Phase 1 of an op that reads (and writes) the peers' own buffers, then its closing
    sync (chorus.shm.direct.closing): ``on_mapped()`` when every rank offered a registered
    buffer (``where``: chorus.shm.mapped), else ``on_direct()`` (single copy through CMA)."""
    with direct.closing(sync, ctx):
        if where is not None:
            on_mapped()
        else:
            on_direct()


class CountsDisagree(BufferMismatchError):
    """Raised on every rank at the same sync, so the group stays in step and usable."""


def _counts_disagree(send_table: np.ndarray, recv_table: np.ndarray, ctx) -> None:
    src, dst = (int(x) for x in np.argwhere(send_table != recv_table.T)[0])
    raise CountsDisagree(
        f"{ctx.describe()}: group rank {src} sends {int(send_table[src, dst])} elements to group "
        f"rank {dst}, which expects {int(recv_table[dst, src])}. Make every rank's output split "
        "sizes match what the others send it.")
