"""Helper threads that split one rank's large copies and reductions (chorus.shm.collectives).

A shared-memory collective on large messages is a sequence of numpy copies and
reductions, and numpy releases the GIL inside them (as ctypes does inside
``process_vm_readv``).  When the host has more cores than ranks, a rank can run each
phase's work in ``parts`` element ranges at once: the caller's thread takes part 0, the
crew's helper threads the others.  Results do not change: every element is computed by
the same numpy call on the same rows, only by another thread (a reduction is split only
into rows long enough that chorus.reductions reduces them element by element, see
``chorus.shm.phases.rows_part``).

``CHORUS_SHM_THREADS``: threads per rank for this work, the caller's included (1 = no
helpers).  Default: the CPUs this process may use divided by the ranks on its host, at
most ``MAX_THREADS``; ranks that are threads of one process get none.  ``ENABLED``
(module attribute, read per op) turns splitting off for comparisons in one process
(bench/ab_probe.py).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger("chorus")
MAX_THREADS = 4
ENABLED = True


def threads_for(ranks_here: int, cpus: int, thread_ranks: bool) -> int:
    """Threads per rank (``CHORUS_SHM_THREADS``, else ``cpus // ranks_here``, 1 to MAX_THREADS).

    A malformed ``CHORUS_SHM_THREADS`` is reported and ignored rather than raised: it is
    read while the group's window is being set up, where one rank failing alone would
    leave the others waiting for it."""
    env = os.environ.get("CHORUS_SHM_THREADS", "").strip()
    if env:
        try:
            value = int(env)
        except ValueError:
            value = 0
        if value >= 1:
            return value
        log.warning("chorus: CHORUS_SHM_THREADS=%r is not a whole number of threads >= 1; "
                    "using the default", env)
    if thread_ranks:
        return 1
    return max(1, min(MAX_THREADS, cpus // max(1, ranks_here)))


class Crew:
    """``threads - 1`` daemon helper threads, started on first use (and again in a process
    forked after they started, which has none of them)."""

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
