"""The collectives over a group's shared-memory window: written once, read many.

Theory of operation.  An op is a sequence of *phases* separated by syncs (chorus.shm.sync).
In each phase a rank writes into the window's regions of the current parity ``p`` and
reads what the others wrote in the previous phase, from parity ``p ^ 1`` (chorus.shm.window
explains why that makes one sync per phase enough).  Large messages go chunk by chunk
and the chunks are pipelined: stage ``i`` of an algorithm handles chunk ``j`` in phase
``j + i``, so while one rank still reduces chunk ``j`` the others already copy in chunk
``j + 1``::

    phase        0         1           2            3
    stage 0    in(0)     in(1)       in(2)
    stage 1              reduce(0)   reduce(1)    reduce(2)
    stage 2                          out(0)       out(1)      out(2)   <- next op's phase 0
           sync       sync        sync          sync

The last phase has no sync of its own: it overlaps the next op's first phase (which
writes the other parity).  Every op has at least one sync, and its first sync checks
that every rank began the same call (fingerprint and sequence number).

Names below: ``W`` ranks, ``me`` this rank's group rank, ``slot[r]`` rank r's data slot of
the parity at hand, ``result`` the shared result slot.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np

from chorus.errors import BufferMismatchError
from chorus.shm.sync import Sync
from chorus.shm.window import Window

Reduce = Callable[[np.ndarray, np.ndarray], None]  # reduce(rows, out): out = op over rows
Stage = Callable[[int, int], None]  # stage(chunk, parity written in this phase)

#: all_reduce / reduce are one-shot (every rank reduces everything) while each rank reads
#: at most this many bytes of the others' data (nbytes x (W - 1)) and the message fits a
#: slot; above, reduce-scatter + all-gather over slices (each rank reduces 1/W of each
#: chunk).  Measured on a 16-core host: one-shot wins up to 64 KiB at W = 4 and 16 KiB at
#: W = 8; at W = 2 it wins below 1 MiB and loses above.
ONESHOT_BYTES = int(os.environ.get("CHORUS_SHM_ONESHOT_BYTES", "").strip() or 256 << 10)


def pipeline(sync: Sync, ctx, n: int, stages: Sequence[Stage], start: int = 0) -> None:
    """Run stage ``i`` of chunk ``j`` in phase ``j + i`` for ``n`` chunks, with one sync
    between phases (none after the last).  ``start``: the first phase to run."""
    last = n + len(stages) - 2
    for k in range(start, last + 1):
        p = sync.parity
        for i, stage in enumerate(stages):
            if 0 <= k - i < n:
                stage(k - i, p)
        if k < last:
            sync.sync(ctx, first=k == 0)


def _chunks(count: int, size: int) -> int:
    """Number of chunks of ``size`` elements for ``count`` (at least 1: every op syncs)."""
    return max(1, -(-count // size))


def _span(j: int, size: int, count: int) -> tuple[int, int]:
    """Chunk ``j``'s element range [lo, hi) (empty past the end)."""
    lo = min(j * size, count)
    return lo, min(lo + size, count)


def _part(n: int, r: int, world: int) -> tuple[int, int]:
    """Rank ``r``'s slice [lo, hi) of ``n`` elements cut into ``world`` near-equal slices."""
    return n * r // world, n * (r + 1) // world


def barrier(win: Window, sync: Sync, ctx) -> None:
    """Every rank raises its counter; every rank waits for all the others."""
    sync.sync(ctx, first=True)


def all_reduce(win: Window, sync: Sync, ctx, data: np.ndarray, reduce: Reduce, root: int = -1) -> None:
    """``data`` <- op over every rank's ``data`` (``root >= 0``: only rank ``root`` gets it: reduce).

    One-shot, for small messages (one sync)::

        phase 0   rank r:      slot[r] <- data
        phase 1   every rank:  data <- reduce(slot[0], slot[1], ..., slot[W-1])

    Large messages: reduce-scatter + all-gather over the slices of each chunk::

        phase k     rank r:  slot[r] <- data[chunk k]
        phase k+1   rank r:  result[slice r] <- reduce(slot[0..W-1][slice r])
        phase k+2   rank r:  data[chunk k] <- result             (all W slices)

    Every rank computes the same numpy reduction of the same rows, so results are
    bit-identical on every rank.
    """
    me, dt, count = win.rank, data.dtype, data.size
    readers = root < 0 or me == root
    size = win.capacity(dt)
    if data.nbytes * (win.world - 1) <= ONESHOT_BYTES and count <= size:
        mine, stacks = win.small(dt, count)  # the fast path: cached views
        p = sync.parity
        mine[p][...] = data
        sync.sync(ctx, first=True)
        if readers:
            reduce(stacks[p], data)
        return

    def copy_in(j: int, p: int) -> None:
        lo, hi = _span(j, size, count)
        win.slot_of(p, me, dt, 0, hi - lo)[...] = data[lo:hi]

    def reduce_slice(j: int, p: int) -> None:
        lo, hi = _span(j, size, count)
        a, b = _part(hi - lo, me, win.world)
        reduce(win.stack(p ^ 1, dt, a, b - a), win.result(p, dt, a, b - a))

    def copy_out(j: int, p: int) -> None:
        lo, hi = _span(j, size, count)
        if readers:
            data[lo:hi] = win.result(p ^ 1, dt, 0, hi - lo)

    pipeline(sync, ctx, _chunks(count, size), (copy_in, reduce_slice, copy_out))


def broadcast(win: Window, sync: Sync, ctx, data: np.ndarray, root: int) -> None:
    """``data`` of rank ``root`` -> ``data`` of every rank, through the whole data area::

        phase k     root:        area <- data[chunk k]
        phase k+1   other ranks: data[chunk k] <- area
    """
    me, dt, count = win.rank, data.dtype, data.size
    size = win.world * win.capacity(dt)

    def copy_in(j: int, p: int) -> None:
        lo, hi = _span(j, size, count)
        if me == root:
            win.region(p, dt, 0, hi - lo)[...] = data[lo:hi]

    def copy_out(j: int, p: int) -> None:
        lo, hi = _span(j, size, count)
        if me != root:
            data[lo:hi] = win.region(p ^ 1, dt, 0, hi - lo)

    pipeline(sync, ctx, _chunks(count, size), (copy_in, copy_out))


def all_gather(win: Window, sync: Sync, ctx, inp: np.ndarray, out: np.ndarray | None) -> None:
    """Block r of ``out`` <- rank r's ``inp`` (``out`` None: this rank gathers nothing)::

        phase k     rank r:          slot[r] <- inp[chunk k]
        phase k+1   ranks with out:  out[r][chunk k] <- slot[r]      for every r, one copy
    """
    me, dt, count = win.rank, inp.dtype, inp.size
    size = win.capacity(dt)
    blocks = None if out is None else out.reshape(win.world, count)

    def copy_in(j: int, p: int) -> None:
        lo, hi = _span(j, size, count)
        win.slot_of(p, me, dt, 0, hi - lo)[...] = inp[lo:hi]

    def copy_out(j: int, p: int) -> None:
        lo, hi = _span(j, size, count)
        if blocks is not None:
            blocks[:, lo:hi] = win.stack(p ^ 1, dt, 0, hi - lo)

    pipeline(sync, ctx, _chunks(count, size), (copy_in, copy_out))


def scatter(win: Window, sync: Sync, ctx, inp: np.ndarray | None, out: np.ndarray, root: int) -> None:
    """Block r of rank ``root``'s ``inp`` -> rank r's ``out``::

        phase k     root:    slot[r] <- inp[r][chunk k]   for every r, one copy
        phase k+1   rank r:  out[chunk k] <- slot[r]
    """
    me, dt, count = win.rank, out.dtype, out.size
    size = win.capacity(dt)

    def copy_in(j: int, p: int) -> None:
        lo, hi = _span(j, size, count)
        if me == root:
            win.stack(p, dt, 0, hi - lo)[...] = inp.reshape(win.world, count)[:, lo:hi]

    def copy_out(j: int, p: int) -> None:
        lo, hi = _span(j, size, count)
        out[lo:hi] = win.slot_of(p ^ 1, me, dt, 0, hi - lo)

    pipeline(sync, ctx, _chunks(count, size), (copy_in, copy_out))


def _offsets(counts: Sequence[int]) -> list[int]:
    """Where each block starts in a concatenation of blocks of ``counts`` elements."""
    return [0, *accumulate(counts)][:-1]


def reduce_scatter(win: Window, sync: Sync, ctx, inp: np.ndarray, out: np.ndarray,
                   counts: Sequence[int], reduce: Reduce) -> None:
    """Block r of ``inp`` (``counts[r]`` elements), reduced over every rank -> rank r's ``out``.

    Each slot is cut into W pieces, piece q for block q (round k carries the k-th
    ``piece``-sized part of every block)::

        phase k     rank r:  slot[r].piece[q] <- inp[block q][round k]   for every q
        phase k+1   rank r:  out[round k] <- reduce(slot[0..W-1].piece[r])
    """
    me, w, dt = win.rank, win.world, out.dtype
    piece = win.capacity(dt) // w
    uniform = len(set(counts)) <= 1
    starts = None if uniform else _offsets(counts)
    mine = counts[me]

    def copy_in(j: int, p: int) -> None:
        if uniform:
            lo, hi = _span(j, piece, counts[0])
            win.pieces(p, me, dt, piece, hi - lo)[...] = inp.reshape(w, counts[0])[:, lo:hi]
            return
        for q in range(w):
            lo, hi = _span(j, piece, counts[q])
            win.slot_of(p, me, dt, q * piece, hi - lo)[...] = inp[starts[q] + lo: starts[q] + hi]

    def reduce_mine(j: int, p: int) -> None:
        lo, hi = _span(j, piece, mine)
        reduce(win.stack(p ^ 1, dt, me * piece, hi - lo), out[lo:hi])

    pipeline(sync, ctx, _chunks(max(counts, default=0), piece), (copy_in, reduce_mine))


def all_to_all(win: Window, sync: Sync, ctx, inp: np.ndarray, out: np.ndarray,
               send_counts: Sequence[int], recv_counts: Sequence[int]) -> None:
    """Rank r's block q of ``inp`` -> rank q's block r of ``out``; blocks may differ in size.

    Each slot is cut into W pieces, piece q for rank q; the first phase also publishes
    every rank's send and receive counts, so that all ranks agree on the number of rounds
    and a send/receive size disagreement is reported on every rank::

        phase k     rank r:  slot[r].piece[q] <- inp[block q][round k]    for every q
        phase k+1   rank q:  out[block r][round k] <- slot[r].piece[q]    for every r
    """
    me, w, dt = win.rank, win.world, out.dtype
    piece = win.capacity(dt) // w
    uniform = len(set(send_counts) | set(recv_counts)) <= 1
    if not uniform:
        sends, recvs = _offsets(send_counts), _offsets(recv_counts)
    c = send_counts[0]

    def copy_in(j: int, p: int) -> None:
        if uniform:
            lo, hi = _span(j, piece, c)
            win.pieces(p, me, dt, piece, hi - lo)[...] = inp.reshape(w, c)[:, lo:hi]
            return
        for q in range(w):
            lo, hi = _span(j, piece, send_counts[q])
            win.slot_of(p, me, dt, q * piece, hi - lo)[...] = inp[sends[q] + lo: sends[q] + hi]

    def copy_out(j: int, p: int) -> None:
        if uniform:
            lo, hi = _span(j, piece, c)
            out.reshape(w, c)[:, lo:hi] = win.stack(p ^ 1, dt, me * piece, hi - lo)
            return
        for r in range(w):
            lo, hi = _span(j, piece, recv_counts[r])
            out[recvs[r] + lo: recvs[r] + hi] = win.slot_of(p ^ 1, r, dt, me * piece, hi - lo)

    p = sync.parity
    send_table, recv_table = win.tables(p)
    send_table[me] = send_counts
    recv_table[me] = recv_counts
    copy_in(0, p)
    sync.sync(ctx, first=True)
    if not np.array_equal(send_table, recv_table.T):
        _counts_disagree(send_table, recv_table, ctx)
    rounds = _chunks(int(send_table.max()), piece)  # every rank's counts decide, not just mine
    pipeline(sync, ctx, rounds, (copy_in, copy_out), start=1)


class CountsDisagree(BufferMismatchError):
    """Raised on every rank at the same sync, so the group stays in step and usable."""


def _counts_disagree(send_table: np.ndarray, recv_table: np.ndarray, ctx) -> None:
    src, dst = (int(x) for x in np.argwhere(send_table != recv_table.T)[0])
    raise CountsDisagree(
        f"{ctx.describe()}: group rank {src} sends {int(send_table[src, dst])} elements to group "
        f"rank {dst}, which expects {int(recv_table[dst, src])}. Make every rank's output split "
        "sizes match what the others send it.")
