"""Single copy: shared-memory collectives that copy each byte once, peer to peer.

From ``cma_bytes`` (and when the group's members agreed at window creation that they
can, chorus.shm.cma), the data does not pass through the window: a rank reads the peers'
buffers straight into its own with ``process_vm_readv`` (and the reductions write results
straight into the peers' buffers), so every byte is copied once instead of twice.  Such
an op has two syncs and the window carries only addresses::

    phase 0   rank r:  publish where its buffer starts           (control line, SOURCE)
    sync      (checks every rank called the same op)
    phase 1   rank r:  read the others' buffers, write its result (chorus.shm.cma)
    sync      nobody returns (letting its caller reuse the buffer) while others read or
              write it
    phase 2   (empty: the next op's phase 0)

A rank writes SOURCE again only in the next op's phase 0, after the second sync, when
every rank has read it.  The reads and writes of phase 1 never touch bytes that their
owner or a third rank changes in the same phase (each op's docstring says why).
chorus.shm.collectives decides per op (``use``) and calls these; only the collectives in
``MEASURED`` (all_reduce, reduce, all_gather and gather, scatter, all_to_all) have such
a path, the others always copy through the window.

Names: ``W`` ranks, ``me`` this rank's group rank; ``rank q's x`` is rank q's own buffer
``x``, read or written with chorus.shm.cma.
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from chorus import recorder
from chorus.errors import AbortedError, PeerLostError
from chorus.shm import cma
from chorus.shm.phases import Reduce, chunks, offsets, part_of, parts_for, span
from chorus.shm.sync import SOURCE, Sync
from chorus.shm.window import Window

_NEVER = float("inf")
#: Per collective, ``((largest W, bytes), ...)``: in a group of W ranks, the message size
#: (nccl-tests' size: a rank's larger buffer) from which the collective copies once, peer
#: to peer (chorus.shm.cma), instead of through the window (the first entry whose largest
#: W is at least W applies).  Collectives not listed always take the copy path.
#:
#: From paired runs at W = 2, 4, 8 (``git show 5907f47^:bench/ab_probe.py``: copy path
#: and single copy alternating op by op in the same processes, medians of 5-7 ops from 1
#: to 256 MiB; docs/benchmarks.md):
#:
#: - all_reduce / reduce: single copy won from 4 MiB at W = 2 (1.2-1.5x) and W = 4
#:   (1.05-1.1x) but lost at W = 8 (the copy path 1.15-1.25x faster): there every rank's
#:   chunk is pinned by 7 readers at once, while the window's 18 MiB stay in cache.
#: - all_gather: single copy won from 1 MiB at W = 2; at W = 4 and 8 only from 16 MiB.
#: - all_to_all: single copy won from 4 MiB at every W (1.2-1.5x), lost at 1 MiB.  In
#:   ``chorus bench --collective all_to_all`` sweeps, which read every op's output, the
#:   copy path won at 4 MiB with W = 4 (1.08-1.15 ms against 1.31-1.46 ms) and lost from
#:   8 MiB (2.66-2.73 against 1.84-1.86 ms); at W = 2 the two tied at 4 MiB (0.85-1.04
#:   against 0.89-0.95 ms), at W = 8 single copy won at 4 MiB (1.16-1.26 against
#:   1.52-1.53 ms).  So W = 3-4: from 8 MiB.
#: - scatter: from 1 MiB (W = 2).
#: - broadcast (7 readers pin the root's pages at once) and reduce_scatter (within 10%
#:   either way) never won: they have no single-copy path.
#:
#: ``CHORUS_SHM_CMA_BYTES`` sets one size for every collective listed and every W (1:
#: always, when the group can; ``CHORUS_SHM_CMA=0``: never).
MEASURED: dict[str, tuple[tuple[float, float], ...]] = {
    "all_reduce": ((4, 4 << 20), (_NEVER, _NEVER)),
    "reduce": ((4, 4 << 20), (_NEVER, _NEVER)),
    "all_gather": ((2, 1 << 20), (_NEVER, 16 << 20)),
    "all_to_all": ((2, 4 << 20), (4, 8 << 20), (_NEVER, 4 << 20)),
    "scatter": ((_NEVER, 1 << 20),),
}


def cma_bytes(win: Window, op: str) -> float:
    """The size from which collective ``op`` copies once in ``win``'s group."""
    return win.settings.cma_bytes or next(nbytes for most, nbytes in MEASURED[op] if win.world <= most)


#: How long a rank that fails in the middle of a single-copy op waits for its peers to
#: stop using its buffers (``closing``).
DRAIN_S = 2.0


def use(win: Window, op: str, nbytes: int) -> bool:
    """Whether collective ``op`` of ``nbytes`` (see ``cma_bytes``) reads the peers' buffers
    directly: the same answer on every rank (one verdict per window, the same sizes)."""
    return win.cma is not None and nbytes >= cma_bytes(win, op)


def open_op(win: Window, sync: Sync, ctx, source: np.ndarray | None) -> list[int]:
    """Phase 0 of a single-copy op: publish where ``source`` starts, sync, and return where
    every rank's starts."""
    win.publish(cma.address(source))
    sync.sync(ctx, first=True)
    return win.words(SOURCE)


@contextmanager
def closing(sync: Sync, ctx) -> Iterator[None]:
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


#: When the crew shares a rank's reads (``from_peers``), each peer's block is cut into
#: pieces of at least this many bytes (one system call each), at least one per thread.
#: At W = 8 (all_to_all, the same probe): 256 KiB pieces were no faster than 1 MiB or
#: one per thread at 4-64 MiB; what the shared queue gained (4 MiB: 0.73-0.81 ms against
#: 1.03-1.14) came from helpers that wake late reading less.
SHARE_PIECE_BYTES = 1 << 20


def from_peers(win: Window, read: Callable[[int, int, int], None], nbytes: int,
               local: Callable[[], None] | None = None) -> None:
    """``read(q, part, parts)`` for every other rank q and every part: reads part ``part``
    of ``parts`` near-equal parts of what comes from q; and ``local()`` (this rank's own
    share, a copy in memory) once, if given.

    With the crew's threads (chorus.shm.phases.Crew), when ``nbytes`` is worth it, the threads
    take the next task from one shared queue: ``local`` first (the caller's thread starts
    on it while the helpers wake up, tens of us on a busy host), then the parts, peer by
    peer.  A helper that wakes late thus does less instead of finishing last.  Parts are
    at least ``SHARE_PIECE_BYTES`` of an even share (``nbytes`` over the other ranks), at
    least one per thread."""
    peers = _others(win.rank, win.world)
    threads = parts_for(win, nbytes)
    if threads <= 1:
        if local is not None:
            local()
        for q in peers:
            read(q, 0, 1)
        return
    parts = max(threads, nbytes // max(1, len(peers)) // SHARE_PIECE_BYTES)
    todo: queue.SimpleQueue = queue.SimpleQueue()
    if local is not None:
        todo.put(local)
    for q in peers:
        for part in range(parts):
            todo.put(functools.partial(read, q, part, parts))

    def share() -> None:
        while True:
            try:
                task = todo.get_nowait()
            except queue.Empty:
                return
            try:
                task()
            except BaseException:
                _empty(todo)  # the other threads stop after their current part
                raise

    win.crew.run([share] * threads)


def _empty(todo: queue.SimpleQueue) -> None:
    while True:
        try:
            todo.get_nowait()
        except queue.Empty:
            return


def read_from(win: Window, ctx, q: int, dst: np.ndarray, src: int) -> None:
    """``dst`` <- ``dst.nbytes`` bytes of rank ``q``'s memory at address ``src``."""
    win.cma.read_one(ctx, q, cma.address(dst), src, dst.nbytes)


def copy_unless_same(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` unless they are the same memory (in-place all_gather)."""
    if cma.address(dst) != cma.address(src):
        cma.copy(dst, src)


def _reduce_rows(win: Window, ctx, sources: list[int], offset: int, own: np.ndarray,
                 out: np.ndarray | None, reduce: Reduce, writes: Sequence[int]) -> None:
    """``out`` <- reduce over ranks of the ``own.size`` elements at byte ``offset`` of every
    rank's source (``own``: this rank's, here), then the result -> the same place in ranks
    ``writes``' sources.  ``out`` None: private scratch.  The rows are read into private
    scratch in rank order, so ``reduce`` sees the rows the copy path sees (same bits); in
    groups of 2 this rank's own row is passed where it is (two rows are reduced by one
    elementwise call, which may write over an input row), except for complex dtypes."""
    w, me, n, peers = win.world, win.rank, own.size, win.cma
    first = (me + 1) % w  # (row q starts at the offset in its page of rank q's source, for the first peer)
    like = sources[first] + offset - first * own.nbytes
    like -= like % own.itemsize  # (a peer's unaligned array: keep the scratch rows aligned)
    scratch = peers.scratch((w + 1) * own.nbytes, like).view(own.dtype).reshape(w + 1, n)
    rows = scratch[:w]
    for q in _others(me, w):
        read_from(win, ctx, q, rows[q], sources[q] + offset)
    out = scratch[w] if out is None else out
    start = time.perf_counter() if recorder.current is not None else 0.0
    if w == 2 and own.dtype.kind != "c":  # one elementwise call: this rank's row is read where it is
        reduce([own, rows[1]] if me == 0 else [rows[0], own], out)
    else:  # (numpy's complex multiply of short arrays differs in the last bit when done in place)
        rows[me] = own
        reduce(rows, out)
    if start:
        recorder.transfer("reduce", ctx, "shm", start, w * own.nbytes)
    for q in writes:
        if q != me and not win.gave_up(q, ctx.seq):  # its caller may own the memory again
            peers.write_one(ctx, q, cma.address(out), sources[q] + offset, out.nbytes)


def all_reduce(win: Window, sync: Sync, ctx, data: np.ndarray, reduce: Reduce, root: int) -> None:
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
    sources = open_op(win, sync, ctx, data)
    with closing(sync, ctx):
        reduce_everywhere(win, ctx, data, reduce, root, sources)


def reduce_everywhere(win: Window, ctx, data: np.ndarray, reduce: Reduce, root: int, sources: list[int]) -> None:
    """Phase 1 of ``all_reduce``, given where every rank's ``data`` starts."""
    me, dt, count = win.rank, data.dtype, data.size
    size = win.capacity(dt)
    writes = range(win.world) if root < 0 else (root,)
    for j in range(chunks(count, size)):
        lo, hi = span(j, size, count)
        a, b = part_of(hi - lo, me, win.world)
        own = data[lo + a: lo + b]
        _reduce_rows(win, ctx, sources, (lo + a) * dt.itemsize, own, own if me in writes else None,
                     reduce, writes)


def all_to_all(win: Window, ctx, inp: np.ndarray, out: np.ndarray, send_table: np.ndarray,
               recv_counts: Sequence[int]) -> None:
    """Phase 1 of all_to_all with single copy: block ``me`` of every rank's ``inp``, read
    into ``out`` (the counts come from the table every rank published)."""
    me, size, peers = win.rank, out.itemsize, win.cma
    sources = win.words(SOURCE)
    recvs = offsets(recv_counts)
    starts = send_table[:, :me].sum(axis=1).tolist()  # where block me starts in each rank's inp
    base = cma.address(out)

    def read_block(q: int, part: int, parts: int) -> None:
        a, b = part_of(recv_counts[q], part, parts)
        peers.read_one(ctx, q, base + (recvs[q] + a) * size, sources[q] + (starts[q] + a) * size, (b - a) * size)

    def copy_own() -> None:
        cma.copy(out[recvs[me]: recvs[me] + recv_counts[me]], inp[starts[me]: starts[me] + recv_counts[me]])

    from_peers(win, read_block, out.nbytes, copy_own)
