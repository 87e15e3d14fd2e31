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

*Parts*: a numpy copy or reduction releases the GIL (as ctypes does inside
``process_vm_readv``), so when the host has more cores than ranks a rank can run each
phase's stages in ``parts`` element ranges at once: the caller's thread takes part 0,
the helper threads of its ``Crew`` the others (``CHORUS_SHM_THREADS``, chorus.shm.
placement).  Results do not change: every element is computed by the same numpy call on
the same rows, only by another thread (a reduction is split only into rows long enough
that chorus.reductions reduces them element by element, ``rows_part``).

With a recorder attached (chorus.recorder), each stage call that moved bytes reports an
event: a stage named ``reduce*`` a ``reduce``, any other a ``copy``.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np

from chorus import recorder
from chorus.shm.sync import Sync
from chorus.shm.window import Window

Reduce = Callable[[np.ndarray, np.ndarray], None]  # reduce(rows, out): out = op over rows ((W, n) or a list of W)
#: stage(chunk, parity written in this phase, part, parts) -> bytes: does part ``part`` of
#: ``parts`` element ranges of its work on the chunk and returns the bytes it copied (a
#: reduction: the bytes of the rows it reduced)
Stage = Callable[[int, int, int, int], int]

#: A reduction is split only into rows at least this long (fewer parts, or none), the
#: length from which chorus.reductions' row reduction always reduces element by element
#: (shorter rows may take ``ufunc.reduce(axis=0)``, whose bits depend on the row length),
#: so that splitting never changes a result's bits (``rows_part``).
PART_ROW_BYTES = 64 << 10
#: Whether phases are split at all, read per op (the paired probe that turned it off to
#: compare: ``git show 5907f47^:bench/ab_probe.py``).
CREW_ENABLED = True


def parts_for(win: Window, nbytes: int, message: int | None = None) -> int:
    """Parts for phases that move ``nbytes`` per rank, each at least
    ``CHORUS_SHM_PART_BYTES`` (less work does not pay for waking a helper thread).
    ``message``: the op's size, on the copy path, which splits phases only from
    ``CHORUS_SHM_COPY_CREW_BYTES`` (the paired probe in
    ``git show 5907f47^:bench/ab_probe.py``, W = 8, "copyc" against "copy": helpers made
    all_reduce 8-12% faster at 16 MiB, slower at 1 MiB, either way at 4 MiB);
    single copy's shared reads (chorus.shm.direct.from_peers) are split at any size
    (all_to_all at 4 MiB: 0.62 ms, where the copy path took 0.99-1.43 ms)."""
    team = win.crew
    if team is None or not CREW_ENABLED or (message is not None and message < win.settings.copy_crew_bytes):
        return 1
    return max(1, min(team.threads, nbytes // win.settings.part_bytes))


def pipeline(sync: Sync, ctx, n: int, stages: Sequence[Stage], start: int = 0, win: Window | None = None,
             parts: int = 1, began: bool = False) -> None:
    """Run stage ``i`` of chunk ``j`` in phase ``j + i`` for ``n`` chunks, with one sync
    between phases (none after the last).  ``start``: the first phase to run.  ``parts``
    > 1: each phase's stages run in that many element ranges at once, on ``win``'s crew.
    ``began``: the op had its first sync already (phase 0's sync is then a plain one)."""
    last = n + len(stages) - 2
    if recorder.current is not None:
        stages = [recorded(stage, ctx) for stage in stages]
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


def recorded(stage: Stage, ctx) -> Stage:
    """``stage`` of op ``ctx``, reporting each call that moved bytes to the recorder."""
    name = stage.__name__
    what = "reduce" if name.startswith("reduce") else "copy"

    def run(j: int, p: int, part: int, parts: int) -> int:
        start = time.perf_counter()
        nbytes = stage(j, p, part, parts)
        if nbytes:
            recorder.transfer(what, ctx, "shm", start, nbytes, stage=name, chunk=j)
        return nbytes

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

    def copy_in(j: int, p: int, part: int, parts: int) -> int:
        lo, hi = span(j, size, src.size)
        a, b = sub(0, hi - lo, part, parts)
        win.slot_of(p, win.rank, src.dtype, a, b - a)[...] = src[lo + a: lo + b]
        return (b - a) * src.itemsize

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


class Crew:
    """``threads - 1`` daemon helper threads that run the parts of a rank's phases, started
    on first use (and again in a process forked after they started, which has none)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._inboxes: list[queue.SimpleQueue] = []
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        self.handed = 0  # tasks run on helpers so far (tests check the crew was used)

    def __repr__(self) -> str:
        return f"Crew(threads={self.threads})"

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Run ``tasks[0]`` here and the others on helpers (at most ``threads`` tasks); wait
        for all of them, even when interrupted, then raise the first error any of them
        raised.  A closed crew runs every task here, one after the other."""
        if len(tasks) > self.threads:
            raise ValueError(f"{len(tasks)} tasks for a crew of {self.threads} threads")
        with self._lock:  # close() cannot slip in between starting helpers and handing out
            if self._closed:
                handed: Sequence[Callable[[], None]] = ()
            else:
                self._start(len(tasks) - 1)
                handed = tasks[1:]
                for inbox, task in zip(self._inboxes, handed, strict=False):
                    inbox.put(task)
                self.handed += len(handed)
        first: BaseException | None = None
        for task in (tasks[0], *tasks[len(handed) + 1:]):
            try:
                task()
            except BaseException as exc:  # the helpers use our buffers: collect them first
                first = first or exc
        pending = len(handed)
        while pending:
            try:
                error = self._done.get()
            except BaseException as exc:  # e.g. Ctrl-C: the helpers still write our buffers
                first = first or exc
                continue
            pending -= 1
            first = first or error
        if first is not None:
            raise first

    def close(self) -> None:
        """Stop the helpers (each finishes the task at hand first); later runs use no helpers."""
        with self._lock:
            self._closed = True
            for inbox in self._inboxes:
                inbox.put(None)
            self._inboxes = []

    def _start(self, helpers: int) -> None:
        """Have at least ``helpers`` helper threads.  Caller holds ``_lock``."""
        if self._pid != os.getpid():  # forked: the helpers stayed in the parent
            self._pid, self._inboxes, self._done = os.getpid(), [], queue.SimpleQueue()
        while len(self._inboxes) < helpers:
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox, self._done), daemon=True,
                             name=f"chorus-shm-helper-{len(self._inboxes) + 1}").start()
            self._inboxes.append(inbox)

    @staticmethod
    def _serve(inbox: queue.SimpleQueue, done: queue.SimpleQueue) -> None:
        while True:
            task = inbox.get()
            if task is None:
                return
            try:
                task()
            except BaseException as exc:
                done.put(exc)
            else:
                done.put(None)
