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

Single copy.  From ``cma_bytes`` (and when the group's members agreed at window
creation that they can, chorus.shm.cma), the data does not pass through the window: a
rank reads the peers' buffers straight into its own with ``process_vm_readv`` (and the
reductions write results straight into the peers' buffers), so every byte is copied once
instead of twice.  Such an op has two syncs and the window carries only addresses::

    phase 0   rank r:  publish where its buffer starts           (control line, SOURCE)
    sync      (checks every rank called the same op)
    phase 1   rank r:  read the others' buffers, write its result (chorus.shm.cma)
    sync      nobody returns (letting its caller reuse the buffer) while others read or
              write it
    phase 2   (empty: the next op's phase 0)

A rank writes SOURCE again only in the next op's phase 0, after the second sync, when
every rank has read it.  The reads and writes of phase 1 never touch bytes that their
owner or a third rank changes in the same phase (each op's docstring says why).

Names below: ``W`` ranks, ``me`` this rank's group rank, ``slot[r]`` rank r's data slot of
the parity at hand, ``result`` the shared result slot; ``rank q's x`` is rank q's own
buffer ``x``, read or written with chorus.shm.cma.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import accumulate

import numpy as np

from chorus.errors import AbortedError, BufferMismatchError, PeerLostError
from chorus.shm import cma, crew
from chorus.shm.sync import SOURCE, Sync
from chorus.shm.window import Window

Reduce = Callable[[np.ndarray, np.ndarray], None]  # reduce(rows, out): out = op over rows
#: stage(chunk, parity written in this phase, part, parts): does part ``part`` of
#: ``parts`` element ranges of its work on the chunk (chorus.shm.crew runs the parts at once)
Stage = Callable[[int, int, int, int], None]

#: all_reduce / reduce are one-shot (every rank reduces everything) while each rank reads
#: at most this many bytes of the others' data (nbytes x (W - 1)) and the message fits a
#: slot; above, reduce-scatter + all-gather over slices (each rank reduces 1/W of each
#: chunk).  Measured on a 16-core host: one-shot wins up to 64 KiB at W = 4 and 16 KiB at
#: W = 8; at W = 2 it wins below 1 MiB and loses above.
def _env_bytes(name: str, default: int) -> int:
    """A byte count from environment variable ``name`` (``default`` if unset)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: give a whole number of bytes (default {default})") from None


ONESHOT_BYTES = _env_bytes("CHORUS_SHM_ONESHOT_BYTES", 256 << 10)


_NEVER = float("inf")
#: Per collective, ``((largest W, bytes), ...)``: in a group of W ranks, the message size
#: (nccl-tests' size: a rank's larger buffer) from which the collective copies once, peer
#: to peer (chorus.shm.cma), instead of through the window (the first entry whose largest
#: W is at least W applies).
#:
#: Measured on the 16-core host (2026-11-26, W = 2, 4, 8; copy path, single copy and gloo
#: alternating op by op in the same processes, medians of 5-7 ops from 1 to 256 MiB;
#: docs/benchmarks.md):
#:
#: - all_reduce / reduce: single copy won from 4 MiB at W = 2 (1.2-1.5x) and W = 4
#:   (1.05-1.1x) but lost at W = 8 (the copy path 1.15-1.25x faster): there every rank's
#:   chunk is pinned by 7 readers at once, while the window's 18 MiB stay in cache.
#: - broadcast: the copy path won or tied at every W and size (single copy: 7 readers pin
#:   the root's pages at once).
#: - all_gather: single copy won from 1 MiB at W = 2; at W = 4 and 8 only from 16 MiB.
#: - all_to_all: single copy won from 4 MiB at every W (1.2-1.5x), lost at 1 MiB.
#: - reduce_scatter: within 10% either way: the copy path.
#: - scatter (not measured there): from 1 MiB, as measured on a 2-core VM at W = 2.
#:
#: ``CHORUS_SHM_CMA_BYTES`` sets one size for every collective and W (1: always, when the
#: group can; ``CHORUS_SHM_CMA=0``: never).
MEASURED: dict[str, tuple[tuple[float, float], ...]] = {
    "all_reduce": ((4, 4 << 20), (_NEVER, _NEVER)),
    "reduce": ((4, 4 << 20), (_NEVER, _NEVER)),
    "broadcast": ((_NEVER, _NEVER),),
    "all_gather": ((2, 1 << 20), (_NEVER, 16 << 20)),
    "all_to_all": ((_NEVER, 4 << 20),),
    "scatter": ((_NEVER, 1 << 20),),
    "reduce_scatter": ((_NEVER, _NEVER),),
}


def _cma_override() -> dict[str, float] | None:
    """``CHORUS_SHM_CMA_BYTES`` for every collective, or None (``MEASURED`` applies)."""
    env = os.environ.get("CHORUS_SHM_CMA_BYTES", "").strip()
    return dict.fromkeys(MEASURED, int(env)) if env else None


#: Per collective, the size from which it copies once, whatever W (None: ``MEASURED``).
CMA_BYTES = _cma_override()


def cma_bytes(op: str, world: int) -> float:
    """The size from which collective ``op`` copies once in a group of ``world`` ranks."""
    if CMA_BYTES is not None:
        return CMA_BYTES[op]
    return next(nbytes for most, nbytes in MEASURED[op] if world <= most)
#: How long a rank that fails in the middle of a single-copy op waits for its peers to
#: stop using its buffers (``_closing``).
DRAIN_S = 2.0


#: A phase is split into parts (chorus.shm.crew) only if each part moves at least this
#: many bytes: less work does not pay for waking a helper thread.
PART_BYTES = _env_bytes("CHORUS_SHM_PART_BYTES", 256 << 10)
#: A reduction is split only into rows at least this long (fewer parts, or none), the
#: length from which chorus.reductions' row reduction always reduces element by element
#: (shorter rows may take ``ufunc.reduce(axis=0)``, whose bits depend on the row length),
#: so that splitting never changes a result's bits (``_rows_part``).
PART_ROW_BYTES = 64 << 10


#: The copy path splits phases only for messages of at least this many bytes per rank.
#: Measured at W = 8 on the 16-core host (bench/ab_probe.py, copy vs copy1, medians of 3):
#: helpers made all_reduce 8% faster at 64 MiB but 8-13% slower at 4 and 16 MiB, and
#: broadcast faster from 16 MiB; single copy's shared reads (``_from_peers``) are split
#: from ``PART_BYTES`` on (all_to_all at 4 MiB: 0.62 ms; the copy path took 0.99-1.43 ms).
COPY_PATH_CREW_BYTES = _env_bytes("CHORUS_SHM_COPY_CREW_BYTES", 32 << 20)


def _parts(win: Window, nbytes: int, message: int | None = None) -> int:
    """Parts for phases that move ``nbytes`` per rank; ``message``: the op's size, on the
    copy path (see ``COPY_PATH_CREW_BYTES``)."""
    team = win.crew
    if team is None or not crew.ENABLED or (message is not None and message < COPY_PATH_CREW_BYTES):
        return 1
    return max(1, min(team.threads, nbytes // PART_BYTES))


def pipeline(sync: Sync, ctx, n: int, stages: Sequence[Stage], start: int = 0, win: Window | None = None,
             parts: int = 1) -> None:
    """Run stage ``i`` of chunk ``j`` in phase ``j + i`` for ``n`` chunks, with one sync
    between phases (none after the last).  ``start``: the first phase to run.  ``parts``
    > 1: each phase's stages run in that many element ranges at once, on ``win``'s crew."""
    last = n + len(stages) - 2
    for k in range(start, last + 1):
        p = sync.parity
        if parts > 1:
            due = [(stage, k - i) for i, stage in enumerate(stages) if 0 <= k - i < n]
            win.crew.run([_phase_part(due, p, part, parts) for part in range(parts)])
        else:
            for i, stage in enumerate(stages):
                if 0 <= k - i < n:
                    stage(k - i, p, 0, 1)
        if k < last:
            sync.sync(ctx, first=k == 0)


def _phase_part(due: list, p: int, part: int, parts: int) -> Callable[[], None]:
    """Part ``part`` of one phase's stages (a crew task)."""
    def run() -> None:
        for stage, j in due:
            stage(j, p, part, parts)
    return run


def _sub(lo: int, hi: int, part: int, parts: int) -> tuple[int, int]:
    """Part ``part`` of ``parts`` near-equal parts of the range [lo, hi)."""
    a, b = _part(hi - lo, part, parts)
    return lo + a, lo + b


def _rows_part(lo: int, hi: int, itemsize: int, part: int, parts: int) -> tuple[int, int]:
    """Part ``part`` of the elements [lo, hi) that a reduction splits into at most
    ``parts`` ranges of at least ``PART_ROW_BYTES`` (parts beyond that get nothing)."""
    usable = max(1, min(parts, (hi - lo) * itemsize // PART_ROW_BYTES))
    return _sub(lo, hi, part, usable) if part < usable else (hi, hi)


def _chunks(count: int, size: int) -> int:
    """Number of chunks of ``size`` elements for ``count`` (at least 1: every op syncs)."""
    return max(1, -(-count // size))


def _to_my_slot(win: Window, src: np.ndarray, size: int) -> Stage:
    """The stage that copies chunk j (``size`` elements) of ``src`` into this rank's slot."""

    def copy_in(j: int, p: int, part: int, parts: int) -> None:
        lo, hi = _span(j, size, src.size)
        a, b = _sub(0, hi - lo, part, parts)
        win.slot_of(p, win.rank, src.dtype, a, b - a)[...] = src[lo + a: lo + b]

    return copy_in


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
    bit-identical on every rank.  From ``cma_bytes``: single copy, see
    ``_all_reduce_direct``.
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
    if _direct(win, "all_reduce" if root < 0 else "reduce", data.nbytes):
        _all_reduce_direct(win, sync, ctx, data, reduce, root)
        return

    copy_in = _to_my_slot(win, data, size)

    def reduce_slice(j: int, p: int, part: int, parts: int) -> None:
        lo, hi = _span(j, size, count)
        a, b = _rows_part(*_part(hi - lo, me, win.world), dt.itemsize, part, parts)
        reduce(win.stack(p ^ 1, dt, a, b - a), win.result(p, dt, a, b - a))

    def copy_out(j: int, p: int, part: int, parts: int) -> None:
        lo, hi = _span(j, size, count)
        a, b = _sub(0, hi - lo, part, parts)
        if readers:
            data[lo + a: lo + b] = win.result(p ^ 1, dt, a, b - a)

    pipeline(sync, ctx, _chunks(count, size), (copy_in, reduce_slice, copy_out), win=win,
             parts=_parts(win, min(count, size) * dt.itemsize, data.nbytes))


def broadcast(win: Window, sync: Sync, ctx, data: np.ndarray, root: int) -> None:
    """``data`` of rank ``root`` -> ``data`` of every rank, through the whole data area::

        phase k     root:        area <- data[chunk k]
        phase k+1   other ranks: data[chunk k] <- area

    Single copy (from ``cma_bytes``)::

        phase 1     other ranks: data <- rank root's data       (one read each)
        sync        the root returns only when every rank has read its data
    """
    me, dt, count = win.rank, data.dtype, data.size
    if _direct(win, "broadcast", data.nbytes):
        sources = _open(win, sync, ctx, data)
        with _closing(sync, ctx):
            if me != root:
                _read(win, ctx, root, data, sources[root])
        return
    size = win.world * win.capacity(dt)

    def copy_in(j: int, p: int, part: int, parts: int) -> None:
        lo, hi = _span(j, size, count)
        a, b = _sub(lo, hi, part, parts)
        if me == root:
            win.region(p, dt, a - lo, b - a)[...] = data[a:b]

    def copy_out(j: int, p: int, part: int, parts: int) -> None:
        lo, hi = _span(j, size, count)
        a, b = _sub(lo, hi, part, parts)
        if me != root:
            data[a:b] = win.region(p ^ 1, dt, a - lo, b - a)

    pipeline(sync, ctx, _chunks(count, size), (copy_in, copy_out), win=win,
             parts=_parts(win, min(count, size) * dt.itemsize, message=data.nbytes))


def all_gather(win: Window, sync: Sync, ctx, inp: np.ndarray, out: np.ndarray | None) -> None:
    """Block r of ``out`` <- rank r's ``inp`` (``out`` None: this rank gathers nothing)::

        phase k     rank r:          slot[r] <- inp[chunk k]
        phase k+1   ranks with out:  out[r][chunk k] <- slot[r]      for every r, one copy

    Single copy (from ``cma_bytes`` of output; ``inp`` may be this rank's block of ``out``)::

        phase 1     ranks with out:  out[q] <- rank q's inp          for every q
        sync        nobody returns while others read its inp
    """
    me, dt, count = win.rank, inp.dtype, inp.size
    size = win.capacity(dt)
    blocks = None if out is None else out.reshape(win.world, count)
    if _direct(win, "all_gather", win.world * inp.nbytes):
        sources = _open(win, sync, ctx, inp)
        with _closing(sync, ctx):
            if blocks is not None:
                _from_peers(win, lambda q: _read(win, ctx, q, blocks[q], sources[q]), win.world * inp.nbytes)
                _copy(blocks[me], inp)
        return

    copy_in = _to_my_slot(win, inp, size)

    def copy_out(j: int, p: int, part: int, parts: int) -> None:
        lo, hi = _span(j, size, count)
        a, b = _sub(0, hi - lo, part, parts)
        if blocks is not None:
            blocks[:, lo + a: lo + b] = win.stack(p ^ 1, dt, a, b - a)

    pipeline(sync, ctx, _chunks(count, size), (copy_in, copy_out), win=win,
             parts=_parts(win, win.world * min(count, size) * dt.itemsize,
                          message=win.world * inp.nbytes))


def scatter(win: Window, sync: Sync, ctx, inp: np.ndarray | None, out: np.ndarray, root: int) -> None:
    """Block r of rank ``root``'s ``inp`` -> rank r's ``out``::

        phase k     root:    slot[r] <- inp[r][chunk k]   for every r, one copy
        phase k+1   rank r:  out[chunk k] <- slot[r]

    Single copy (from ``cma_bytes`` of the root's input)::

        phase 1     rank r:  out <- rank root's inp[r]
        sync        the root returns only when every rank has read its inp
    """
    me, dt, count = win.rank, out.dtype, out.size
    size = win.capacity(dt)
    if _direct(win, "scatter", win.world * out.nbytes):
        sources = _open(win, sync, ctx, inp if me == root else None)
        with _closing(sync, ctx):
            if me == root:
                out[...] = inp[me * count: (me + 1) * count]
            else:
                _read(win, ctx, root, out, sources[root] + me * out.nbytes)
        return

    def copy_in(j: int, p: int, part: int, parts: int) -> None:
        lo, hi = _span(j, size, count)
        a, b = _sub(0, hi - lo, part, parts)
        if me == root:
            win.stack(p, dt, a, b - a)[...] = inp.reshape(win.world, count)[:, lo + a: lo + b]

    def copy_out(j: int, p: int, part: int, parts: int) -> None:
        lo, hi = _span(j, size, count)
        a, b = _sub(0, hi - lo, part, parts)
        out[lo + a: lo + b] = win.slot_of(p ^ 1, me, dt, a, b - a)

    pipeline(sync, ctx, _chunks(count, size), (copy_in, copy_out), win=win,
             parts=_parts(win, min(count, size) * dt.itemsize, message=win.world * out.nbytes))


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

    Single copy (from ``cma_bytes`` of input), the same rounds, through private
    scratch instead of the window::

        phase 1     rank r, round k:  rows[q] <- rank q's inp[block r][round k]   for every q
                                      out[round k] <- reduce(rows)
        sync        nobody returns while others read its inp
    """
    me, w, dt = win.rank, win.world, out.dtype
    piece = win.capacity(dt) // w
    if _direct(win, "reduce_scatter", inp.nbytes):
        _reduce_scatter_direct(win, sync, ctx, inp, out, counts, reduce, piece)
        return
    uniform = len(set(counts)) <= 1
    starts = None if uniform else _offsets(counts)
    mine = counts[me]

    def copy_in(j: int, p: int, part: int, parts: int) -> None:
        if uniform:
            lo, hi = _span(j, piece, counts[0])
            a, b = _sub(0, hi - lo, part, parts)
            win.pieces(p, me, dt, piece, hi - lo)[:, a:b] = inp.reshape(w, counts[0])[:, lo + a: lo + b]
            return
        for q in range(w):
            lo, hi = _span(j, piece, counts[q])
            a, b = _sub(0, hi - lo, part, parts)
            win.slot_of(p, me, dt, q * piece + a, b - a)[...] = inp[starts[q] + lo + a: starts[q] + lo + b]

    def reduce_mine(j: int, p: int, part: int, parts: int) -> None:
        lo, hi = _span(j, piece, mine)
        a, b = _rows_part(0, hi - lo, dt.itemsize, part, parts)
        reduce(win.stack(p ^ 1, dt, me * piece + a, b - a), out[lo + a: lo + b])

    rows = min(piece, max(counts, default=0))
    pipeline(sync, ctx, _chunks(max(counts, default=0), piece), (copy_in, reduce_mine), win=win,
             parts=_parts(win, w * rows * dt.itemsize, inp.nbytes))


def all_to_all(win: Window, sync: Sync, ctx, inp: np.ndarray, out: np.ndarray,
               send_counts: Sequence[int], recv_counts: Sequence[int]) -> None:
    """Rank r's block q of ``inp`` -> rank q's block r of ``out``; blocks may differ in size.

    Each slot is cut into W pieces, piece q for rank q; the first phase also publishes
    every rank's send and receive counts, so that all ranks agree on the number of rounds
    and a send/receive size disagreement is reported on every rank::

        phase k     rank r:  slot[r].piece[q] <- inp[block q][round k]    for every q
        phase k+1   rank q:  out[block r][round k] <- slot[r].piece[q]    for every r

    Single copy, when some rank sends ``cma_bytes`` or more (known to all after the
    first sync, from the counts; a rank that sends less also fills round 0 of the copy
    path, in case no rank does)::

        phase 0     rank r:  publish inp's address, its counts     (ranks that send little:
                                                                    also round 0 as above)
        phase 1     rank q:  out[block r] <- rank r's inp[block q]  for every r
        sync        nobody returns while others read its inp

    ``inp`` and ``out`` may be one buffer: then ``inp`` is copied first (others read it
    while this rank writes ``out``).
    """
    me, w, dt = win.rank, win.world, out.dtype
    piece = win.capacity(dt) // w
    uniform = len(set(send_counts) | set(recv_counts)) <= 1
    if not uniform:
        sends, recvs = _offsets(send_counts), _offsets(recv_counts)
    c = send_counts[0]

    def copy_in(j: int, p: int, part: int, parts: int) -> None:
        if uniform:
            lo, hi = _span(j, piece, c)
            a, b = _sub(0, hi - lo, part, parts)
            win.pieces(p, me, dt, piece, hi - lo)[:, a:b] = inp.reshape(w, c)[:, lo + a: lo + b]
            return
        for q in range(w):
            lo, hi = _span(j, piece, send_counts[q])
            a, b = _sub(0, hi - lo, part, parts)
            win.slot_of(p, me, dt, q * piece + a, b - a)[...] = inp[sends[q] + lo + a: sends[q] + lo + b]

    def copy_out(j: int, p: int, part: int, parts: int) -> None:
        if uniform:
            lo, hi = _span(j, piece, c)
            a, b = _sub(0, hi - lo, part, parts)
            out.reshape(w, c)[:, lo + a: lo + b] = win.stack(p ^ 1, dt, me * piece + a, b - a)
            return
        for r in range(w):
            lo, hi = _span(j, piece, recv_counts[r])
            a, b = _sub(0, hi - lo, part, parts)
            out[recvs[r] + lo + a: recvs[r] + lo + b] = win.slot_of(p ^ 1, r, dt, me * piece + a, b - a)

    p = sync.parity
    send_table, recv_table = win.tables(p)
    send_table[me] = send_counts
    recv_table[me] = recv_counts
    if win.cma is not None:
        if np.may_share_memory(inp, out):
            inp = inp.copy()
        win.publish(cma.address(inp))
    if not _direct(win, "all_to_all", sum(send_counts) * dt.itemsize):
        copy_in(0, p, 0, 1)
    sync.sync(ctx, first=True)
    if not np.array_equal(send_table, recv_table.T):
        _counts_disagree(send_table, recv_table, ctx)
    if _direct(win, "all_to_all", int(send_table.sum(axis=1).max()) * dt.itemsize):
        with _closing(sync, ctx):
            _all_to_all_direct(win, ctx, inp, out, send_table, recv_counts)
        return
    most = int(send_table.max())  # every rank's counts decide, not just mine
    parts = _parts(win, w * min(piece, most) * dt.itemsize, message=inp.nbytes)
    pipeline(sync, ctx, _chunks(most, piece), (copy_in, copy_out), start=1, win=win, parts=parts)


class CountsDisagree(BufferMismatchError):
    """Raised on every rank at the same sync, so the group stays in step and usable."""


def _counts_disagree(send_table: np.ndarray, recv_table: np.ndarray, ctx) -> None:
    src, dst = (int(x) for x in np.argwhere(send_table != recv_table.T)[0])
    raise CountsDisagree(
        f"{ctx.describe()}: group rank {src} sends {int(send_table[src, dst])} elements to group "
        f"rank {dst}, which expects {int(recv_table[dst, src])}. Make every rank's output split "
        "sizes match what the others send it.")


# Single copy (chorus.shm.cma): see the module docstring.


def _direct(win: Window, op: str, nbytes: int) -> bool:
    """Whether collective ``op`` of ``nbytes`` (see ``cma_bytes``) reads the peers' buffers
    directly: the same answer on every rank (one verdict per window, the same sizes)."""
    return win.cma is not None and nbytes >= cma_bytes(op, win.world)


def _open(win: Window, sync: Sync, ctx, source: np.ndarray | None) -> list[int]:
    """Phase 0 of a single-copy op: publish where ``source`` starts, sync, and return where
    every rank's starts."""
    win.publish(cma.address(source))
    sync.sync(ctx, first=True)
    return win.words(SOURCE)


@contextmanager
def _closing(sync: Sync, ctx) -> Iterator[None]:
    """Phase 1 of a single-copy op (the ``with`` body), then the op's closing sync.

    A rank that fails in phase 1 marks the op abandoned and waits (at most ``DRAIN_S``)
    until every live peer has arrived at the closing sync or given up, so that nobody
    still reads or writes its buffers when the caller gets them back.

    A peer whose buffer vanished (AbortedError: it left the op, usually because it learnt
    first that another member died) is reported as that death when the transport knows of
    one, so every survivor raises PeerLostError for the rank that died.

    A peer found dead in phase 1 (cma.PeerGone) is reported through that sync, the way
    every other rank learns of it (the transport saw its connection break): raising at
    once would mark this rank as having given up, and the others would report that
    instead of the lost peer.
    """
    try:
        yield
    except cma.PeerGone as lost:
        sync.sync(ctx)
        raise lost from None  # the sync passed: the peer died just after it arrived
    except AbortedError as exc:
        # A peer's buffer went away: it left the op, most often because it learnt first
        # that another member died.  Report that root cause when the transport knows it.
        _leave(sync, ctx)
        cause = sync.transport_error(ctx)
        if isinstance(cause, PeerLostError):
            raise cause from exc
        raise
    except BaseException:
        _leave(sync, ctx)
        raise
    sync.sync(ctx)


def _leave(sync: Sync, ctx) -> None:
    """Leaving a single-copy op half-way: tell the others (their writers stop before the
    next write into this rank's buffers) and give them a moment to stop before the caller
    gets the buffers back."""
    sync.abandon(ctx.seq)
    sync.drain(ctx, DRAIN_S)


def _others(me: int, world: int) -> list[int]:
    """The other ranks, from ``me + 1`` on (W readers do not all start on the same rank)."""
    return [(me + k) % world for k in range(1, world)]


def _from_peers(win: Window, read: Callable[[int], None], nbytes: int) -> None:
    """``read(q)`` for every other rank q, the peers shared among the crew's threads
    (chorus.shm.crew) when ``nbytes`` is worth it."""
    peers = _others(win.rank, win.world)
    parts = min(_parts(win, nbytes), len(peers))
    if parts <= 1:
        for q in peers:
            read(q)
        return

    def share(mine: list[int]) -> Callable[[], None]:
        return lambda: [read(q) for q in mine]

    win.crew.run([share(peers[i::parts]) for i in range(parts)])


def _read(win: Window, ctx, q: int, dst: np.ndarray, src: int) -> None:
    """``dst`` <- ``dst.nbytes`` bytes of rank ``q``'s memory at address ``src``."""
    win.cma.read(ctx, q, [(cma.address(dst), src, dst.nbytes)])


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` unless they are the same memory (in-place all_gather)."""
    if cma.address(dst) != cma.address(src):
        dst[...] = src


def _reduce_rows(win: Window, ctx, sources: list[int], offset: int, own: np.ndarray,
                 out: np.ndarray | None, reduce: Reduce, writes: Sequence[int] = ()) -> None:
    """``out`` <- reduce over ranks of the ``own.size`` elements at byte ``offset`` of every
    rank's source (``own``: this rank's, here), then the result -> the same place in ranks
    ``writes``' sources.  ``out`` None: private scratch.  The rows are read into private
    scratch in rank order, so ``reduce`` sees the rows the copy path sees (same bits)."""
    w, me, n, peers = win.world, win.rank, own.size, win.cma
    scratch = peers.scratch((w + 1) * own.nbytes)[: (w + 1) * own.nbytes].view(own.dtype).reshape(w + 1, n)
    rows = scratch[:w]
    for q in _others(me, w):
        _read(win, ctx, q, rows[q], sources[q] + offset)
    rows[me] = own
    out = scratch[w] if out is None else out
    reduce(rows, out)
    for q in writes:
        if q != me and not win.gave_up(q, ctx.seq):  # its caller may own the memory again
            peers.write(ctx, q, [(cma.address(out), sources[q] + offset, out.nbytes)])


def _all_reduce_direct(win: Window, sync: Sync, ctx, data: np.ndarray, reduce: Reduce, root: int) -> None:
    """all_reduce / reduce with single copy: rank r reduces slice r of each chunk (the copy
    path's chunks and slices, so the same rows give the same bits) from every rank's
    ``data`` and writes the result into every rank's ``data`` (reduce: the root's only)::

        phase 0   rank r:           publish &data
        phase 1   rank r, chunk k:  rows[q] <- rank q's data[chunk k][slice r]   for every q
                                    rank q's data[chunk k][slice r] <- reduce(rows)
                                                          for every q (reduce: q = root)
        sync      nobody returns while others still read or write its data

    Within phase 1 nothing races: slice r of every rank's ``data`` is read, then written,
    by rank r alone.  Non-roots' ``data`` of reduce is only read.
    """
    me, dt, count = win.rank, data.dtype, data.size
    sources = _open(win, sync, ctx, data)
    size = win.capacity(dt)
    writes = range(win.world) if root < 0 else (root,)
    with _closing(sync, ctx):
        for j in range(_chunks(count, size)):
            lo, hi = _span(j, size, count)
            a, b = _part(hi - lo, me, win.world)
            own = data[lo + a: lo + b]
            _reduce_rows(win, ctx, sources, (lo + a) * dt.itemsize, own, own if me in writes else None,
                         reduce, writes)


def _reduce_scatter_direct(win: Window, sync: Sync, ctx, inp: np.ndarray, out: np.ndarray,
                           counts: Sequence[int], reduce: Reduce, piece: int) -> None:
    """reduce_scatter with single copy, in the copy path's rounds of ``piece`` elements
    (see reduce_scatter); ``out`` overlapping ``inp``: ``inp`` is copied first."""
    me, dt = win.rank, out.dtype
    if np.may_share_memory(inp, out):
        inp = inp.copy()
    sources = _open(win, sync, ctx, inp)
    start = _offsets(counts)[me]
    with _closing(sync, ctx):
        for j in range(_chunks(counts[me], piece) if counts[me] else 0):
            lo, hi = _span(j, piece, counts[me])
            own = inp[start + lo: start + hi]
            _reduce_rows(win, ctx, sources, (start + lo) * dt.itemsize, own, out[lo:hi], reduce)


def _all_to_all_direct(win: Window, ctx, inp: np.ndarray, out: np.ndarray, send_table: np.ndarray,
                       recv_counts: Sequence[int]) -> None:
    """Phase 1 of all_to_all with single copy: block ``me`` of every rank's ``inp``, read
    into ``out`` (the counts come from the table every rank published)."""
    me, size = win.rank, out.itemsize
    sources = win.words(SOURCE)
    recvs = _offsets(recv_counts)

    def read(q: int) -> None:
        block = out[recvs[q]: recvs[q] + recv_counts[q]]
        _read(win, ctx, q, block, sources[q] + int(send_table[q, :me].sum()) * size)

    _from_peers(win, read, out.nbytes)
    sends = int(send_table[me, :me].sum())
    out[recvs[me]: recvs[me] + recv_counts[me]] = inp[sends: sends + recv_counts[me]]
