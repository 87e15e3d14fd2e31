"""Phases, chunks and parts: how a shared-memory collective divides its work.

An op is a sequence of *phases* separated by syncs (chorus.shm.sync).  In each phase a
rank writes into the window's regions of the current parity ``p`` and reads what the
others wrote in the previous phase, from parity ``p ^ 1`` (chorus.shm.window explains why
that makes one sync per phase enough).  Large messages go chunk by chunk and the chunks
are pipelined: stage ``i`` of an algorithm handles chunk ``j`` in phase ``j + i``, so
while one rank still reduces chunk ``j`` the others already copy in chunk ``j + 1``::

    phase        0         1           2            3
    stage 0    in(0)     in(1)       in(2)
    stage 1              reduce(0)   reduce(1)    reduce(2)
    stage 2                          out(0)       out(1)      out(2)   <- next op's phase 0
           sync       sync        sync          sync

The last phase has no sync of its own: it overlaps the next op's first phase (which
writes the other parity).  Every op has at least one sync, and its first sync checks
that every rank began the same call (fingerprint and sequence number).

*Parts*: when the rank has helper threads (chorus.shm.crew), each phase's stages can run
in several element ranges at once; a stage is called with its part and the number of
parts and works on that range only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np

from chorus.shm import crew
from chorus.shm.settings import env_int
from chorus.shm.sync import Sync
from chorus.shm.window import Window

Reduce = Callable[[np.ndarray, np.ndarray], None]  # reduce(rows, out): out = op over rows ((W, n) or a list of W)
#: stage(chunk, parity written in this phase, part, parts): does part ``part`` of
#: ``parts`` element ranges of its work on the chunk (chorus.shm.crew runs the parts at once)
Stage = Callable[[int, int, int, int], None]

#: A phase is split into parts (chorus.shm.crew) only if each part moves at least this
#: many bytes: less work does not pay for waking a helper thread.
PART_BYTES = env_int("CHORUS_SHM_PART_BYTES", 256 << 10)
#: A reduction is split only into rows at least this long (fewer parts, or none), the
#: length from which chorus.reductions' row reduction always reduces element by element
#: (shorter rows may take ``ufunc.reduce(axis=0)``, whose bits depend on the row length),
#: so that splitting never changes a result's bits (``rows_part``).
PART_ROW_BYTES = 64 << 10


#: The copy path splits phases only for messages of at least this many bytes per rank.
#: Measured at W = 8 on the 16-core host (bench/ab_probe.py): with the splitting of
#: 8527e0d (parts from 256 KiB, medians of 3) helpers made all_reduce 8% faster at 64 MiB
#: but 8-13% slower at 4 and 16 MiB; with today's (rows of at least 64 KiB; two calls,
#: 5 and 7 rounds, "copyc" vs "copy") 8% and 12% faster at 16 MiB, slower at 1 MiB, and
#: either way at 4 MiB.  Single copy's shared reads (chorus.shm.direct.from_peers) are
#: split from ``PART_BYTES`` on (all_to_all at 4 MiB: 0.62 ms; the copy path took
#: 0.99-1.43 ms).
COPY_PATH_CREW_BYTES = env_int("CHORUS_SHM_COPY_CREW_BYTES", 16 << 20)


def parts_for(win: Window, nbytes: int, message: int | None = None) -> int:
    """Parts for phases that move ``nbytes`` per rank; ``message``: the op's size, on the
    copy path (see ``COPY_PATH_CREW_BYTES``)."""
    team = win.crew
    if team is None or not crew.ENABLED or (message is not None and message < COPY_PATH_CREW_BYTES):
        return 1
    return max(1, min(team.threads, nbytes // PART_BYTES))


def pipeline(sync: Sync, ctx, n: int, stages: Sequence[Stage], start: int = 0, win: Window | None = None,
             parts: int = 1, began: bool = False) -> None:
    """Run stage ``i`` of chunk ``j`` in phase ``j + i`` for ``n`` chunks, with one sync
    between phases (none after the last).  ``start``: the first phase to run.  ``parts``
    > 1: each phase's stages run in that many element ranges at once, on ``win``'s crew.
    ``began``: the op had its first sync already (phase 0's sync is then a plain one)."""
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
            sync.sync(ctx, first=k == 0 and not began)


def _phase_part(due: list, p: int, part: int, parts: int) -> Callable[[], None]:
    """Part ``part`` of one phase's stages (a crew task)."""
    def run() -> None:
        for stage, j in due:
            stage(j, p, part, parts)
    return run


def sub(lo: int, hi: int, part: int, parts: int) -> tuple[int, int]:
    """Part ``part`` of ``parts`` near-equal parts of the range [lo, hi)."""
    a, b = part_of(hi - lo, part, parts)
    return lo + a, lo + b


def rows_part(lo: int, hi: int, itemsize: int, part: int, parts: int) -> tuple[int, int]:
    """Part ``part`` of the elements [lo, hi) that a reduction splits into at most
    ``parts`` ranges of at least ``PART_ROW_BYTES`` (parts beyond that get nothing)."""
    usable = max(1, min(parts, (hi - lo) * itemsize // PART_ROW_BYTES))
    return sub(lo, hi, part, usable) if part < usable else (hi, hi)


def chunks(count: int, size: int) -> int:
    """Number of chunks of ``size`` elements for ``count`` (at least 1: every op syncs)."""
    return max(1, -(-count // size))


def to_my_slot(win: Window, src: np.ndarray, size: int) -> Stage:
    """The stage that copies chunk j (``size`` elements) of ``src`` into this rank's slot."""

    def copy_in(j: int, p: int, part: int, parts: int) -> None:
        lo, hi = span(j, size, src.size)
        a, b = sub(0, hi - lo, part, parts)
        win.slot_of(p, win.rank, src.dtype, a, b - a)[...] = src[lo + a: lo + b]

    return copy_in


def span(j: int, size: int, count: int) -> tuple[int, int]:
    """Chunk ``j``'s element range [lo, hi) (empty past the end)."""
    lo = min(j * size, count)
    return lo, min(lo + size, count)


def part_of(n: int, r: int, world: int) -> tuple[int, int]:
    """Rank ``r``'s slice [lo, hi) of ``n`` elements cut into ``world`` near-equal slices."""
    return n * r // world, n * (r + 1) // world


def offsets(counts: Sequence[int]) -> list[int]:
    """Where each block starts in a concatenation of blocks of ``counts`` elements."""
    return [0, *accumulate(counts)][:-1]
