"""Turn-taking between the benchmark's jobs, so that chorus (and gloo) and MPI are timed
alternately, size by size, on the same machine state, although MPI runs in its own
``mpiexec`` job.

The parent hands out turns (``give_turn``: job name and size index, written atomically to
``<workdir>/turn``) and waits until every rank of that job has written
``done-<job>-<index>-<rank>`` (``wait_done``).  A rank whose job is not on turn sleeps
(backing off to 2 ms), outside any library call, so it takes no CPU from the timed job
(MPICH, for one, busy-polls inside its calls).  Index 0 is the untimed warm-up (and, for
MPI, start-up); index i >= 1 is the i-th size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

_MAX_SLEEP_S = 0.002
#: How often a waiting rank checks that the bench process is still there.
_PARENT_CHECK_S = 1.0


class ParentGone(RuntimeError):
    """The ``chorus bench`` process that hands out turns has exited."""


class Turns:
    """A rank's side.  ``workdir`` None: no other job, every turn is ours at once."""

    def __init__(self, workdir: str | None, job: str, rank: int, parent_pid: int | None = None):
        self.workdir, self.job, self.rank, self.parent_pid = workdir, job, rank, parent_pid

    def wait(self, index: int) -> None:
        if self.workdir is None:
            return
        path, want = os.path.join(self.workdir, "turn"), f"{self.job} {index}"
        sleep, next_check = 50e-6, time.monotonic() + _PARENT_CHECK_S
        while True:
            try:
                with open(path) as f:
                    if f.read() == want:
                        return
            except FileNotFoundError:
                pass
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP_S)
            if self.parent_pid and time.monotonic() > next_check:
                next_check = time.monotonic() + _PARENT_CHECK_S
                if not _alive(self.parent_pid):
                    raise ParentGone(f"chorus bench (pid {self.parent_pid}) has exited")

    def done(self, index: int) -> None:
        if self.workdir is None:
            return
        open(os.path.join(self.workdir, f"done-{self.job}-{index}-{self.rank}"), "w").close()


def give_turn(workdir: str, job: str, index: int) -> None:
    tmp = os.path.join(workdir, "turn.tmp")
    with open(tmp, "w") as f:
        f.write(f"{job} {index}")
    os.replace(tmp, os.path.join(workdir, "turn"))


def wait_done(workdir: str, job: str, index: int, world: int, still_running: Callable[[], bool],
              ) -> bool:
    """Wait until every rank of ``job`` is done with ``index``.  ``still_running()`` is
    called while waiting (it may raise); False from it ends the wait early (returns False)."""
    pending = [os.path.join(workdir, f"done-{job}-{index}-{rank}") for rank in range(world)]
    sleep = 50e-6
    while pending:
        pending = [p for p in pending if not os.path.exists(p)]
        if not pending:
            break
        if not still_running():  # it may have finished its last turn and exited since
            return not [p for p in pending if not os.path.exists(p)]
        time.sleep(sleep)
        sleep = min(sleep * 2, _MAX_SLEEP_S)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
