"""Turn-taking between the benchmark's jobs, so that chorus (and gloo) and MPI are timed
alternately, size by size, on the same machine state, although MPI runs in its own
``mpiexec`` job.

The parent hands out turns (``give_turn``: a record into each rank's FIFO
``<workdir>/turn-<job>-<rank>``) and waits until every rank of that job has written its
record into ``<workdir>/done-<job>`` (``wait_done``).  A rank whose job is not on turn
blocks reading its job's FIFO, outside any library call, so it takes no CPU from the
timed job and does not wake up (MPICH busy-polls inside its calls; chorus's waiters yield
or sleep, and periodic wake-ups of idle processes beside them on a machine with few cores
cost them a time slice).  Index 0 is the untimed warm-up (and, for MPI, start-up); index
i >= 1 is the i-th size.  Records are 16 bytes, written and read whole.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable

from chorus.host.process import pid_alive

_RECORD = 16
#: How often a waiting side checks that the other side is still there.
_PARENT_CHECK_S = 1.0


class ParentGone(RuntimeError):
    """The ``chorus bench`` process that hands out turns has exited."""


def _fifo(workdir: str, name: str) -> int:
    """A read-write descriptor of FIFO ``workdir/name`` (made if missing): opening it
    never blocks, and a reader never sees end-of-file."""
    path = os.path.join(workdir, name)
    try:
        os.mkfifo(path)
    except FileExistsError:
        pass
    return os.open(path, os.O_RDWR)


def _record(text: str) -> bytes:
    return text.encode().ljust(_RECORD - 1)[: _RECORD - 1] + b"\n"


def _read_record(fd: int, timeout: float) -> str | None:
    """The next record from ``fd``, or None after ``timeout`` seconds without one."""
    if not select.select([fd], [], [], timeout)[0]:
        return None
    return os.read(fd, _RECORD).decode().strip()


class Turns:
    """A rank's side.  ``workdir`` None: no other job, every turn is ours at once."""

    def __init__(self, workdir: str | None, job: str, rank: int, parent_pid: int | None = None):
        self.workdir, self.job, self.rank, self.parent_pid = workdir, job, rank, parent_pid
        self._turns = self._done = None

    def wait(self, index: int) -> None:
        if self.workdir is None:
            return
        if self._turns is None:
            self._turns = _fifo(self.workdir, f"turn-{self.job}-{self.rank}")
        while _read_record(self._turns, _PARENT_CHECK_S) != str(index):
            if self.parent_pid and not pid_alive(self.parent_pid):
                raise ParentGone(f"chorus bench (pid {self.parent_pid}) has exited")

    def done(self, index: int) -> None:
        if self.workdir is None:
            return
        if self._done is None:
            self._done = _fifo(self.workdir, f"done-{self.job}")
        os.write(self._done, _record(f"{index} {self.rank}"))


_parent_fds: dict[tuple[str, str], int] = {}


def _parent_fifo(workdir: str, name: str) -> int:
    key = (workdir, name)
    if key not in _parent_fds:
        _parent_fds[key] = _fifo(workdir, name)
    return _parent_fds[key]


def forget(workdir: str) -> None:
    """Close the parent's FIFO descriptors of ``workdir`` (the sweep is over)."""
    for key in [k for k in _parent_fds if k[0] == workdir]:
        os.close(_parent_fds.pop(key))


def give_turn(workdir: str, job: str, index: int, ranks: int = 1) -> None:
    """Hand turn ``index`` to the ``ranks`` ranks of ``job`` (a FIFO each: a rank that
    shared one with others could read their record as well as its own)."""
    for rank in range(ranks):
        os.write(_parent_fifo(workdir, f"turn-{job}-{rank}"), _record(str(index)))


def wait_done(workdir: str, job: str, index: int, world: int, still_running: Callable[[], bool],
              ) -> bool:
    """Wait until every rank of ``job`` is done with ``index``.  ``still_running()`` is
    called while waiting (it may raise); False from it ends the wait (returns False)."""
    fd = _parent_fifo(workdir, f"done-{job}")
    pending = {f"{index} {rank}" for rank in range(world)}
    while pending:
        record = _read_record(fd, 0.2)
        if record is not None:
            pending.discard(record)
        elif not still_running():
            return False
    return True


