"""Helper threads that split one rank's large copies and reductions (chorus.shm.collectives).

A shared-memory collective on large messages is a sequence of numpy copies and
reductions, and numpy releases the GIL inside them (as ctypes does inside
``process_vm_readv``).  When the host has more cores than ranks, a rank can run each
phase's work in ``parts`` element ranges at once: the caller's thread takes part 0, the
crew's helper threads the others.  Results do not change: every element is computed by
the same numpy call on the same rows, only by another thread (the reductions are element
by element; each part's rows stay at least ``reductions``' chain length long, see
``collectives._parts``).

``CHORUS_SHM_THREADS``: threads per rank for this work, the caller's included (1 = no
helpers).  Default: the CPUs this process may use divided by the ranks on its host, at
most ``MAX_THREADS``; ranks that are threads of one process get none.  ``ENABLED``
(module attribute, read per op) turns splitting off for comparisons in one process
(bench/ab_probe.py).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence

MAX_THREADS = 4
ENABLED = True


def threads_for(ranks_here: int, cpus: int, thread_ranks: bool) -> int:
    """Threads per rank (``CHORUS_SHM_THREADS``, else ``cpus // ranks_here``, 1 to MAX_THREADS)."""
    env = os.environ.get("CHORUS_SHM_THREADS", "").strip()
    if env:
        value = int(env)
        if value < 1:
            raise ValueError(f"CHORUS_SHM_THREADS={env!r}: use a whole number of threads, at least 1")
        return value
    if thread_ranks:
        return 1
    return max(1, min(MAX_THREADS, cpus // max(1, ranks_here)))


class Crew:
    """``threads - 1`` daemon helper threads, started on first use."""

    def __init__(self, threads: int):
        self.threads = threads
        self._inboxes: list[queue.SimpleQueue] = []
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.handed = 0  # tasks run on helpers so far (tests check the crew was used)

    def __repr__(self) -> str:
        return f"Crew(threads={self.threads})"

    def run(self, tasks: Sequence[Callable[[], None]]) -> None:
        """Run ``tasks[0]`` here and the others on helpers (at most ``threads`` tasks); wait
        for all of them, then raise the first error any of them raised."""
        if len(tasks) > self.threads:
            raise ValueError(f"{len(tasks)} tasks for a crew of {self.threads} threads")
        self._start(len(tasks) - 1)
        self.handed += len(tasks) - 1
        for inbox, task in zip(self._inboxes, tasks[1:], strict=False):
            inbox.put(task)
        first: BaseException | None = None
        try:
            tasks[0]()
        except BaseException as exc:  # still collect the helpers' ends: they use our buffers
            first = exc
        for _ in tasks[1:]:
            error = self._done.get()
            if first is None and error is not None:
                first = error
        if first is not None:
            raise first

    def close(self) -> None:
        """Stop the helpers (they finish the task at hand first)."""
        with self._lock:
            for inbox in self._inboxes:
                inbox.put(None)
            self._inboxes = []

    def _start(self, helpers: int) -> None:
        if len(self._inboxes) >= helpers:
            return
        with self._lock:
            while len(self._inboxes) < helpers:
                inbox: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(inbox,), daemon=True,
                                 name=f"chorus-shm-helper-{len(self._inboxes) + 1}").start()
                self._inboxes.append(inbox)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            task = inbox.get()
            if task is None:
                return
            try:
                task()
            except BaseException as exc:
                self._done.put(exc)
            else:
                self._done.put(None)
