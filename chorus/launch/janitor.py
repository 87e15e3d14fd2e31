"""Remove a job's ``/dev/shm`` leftovers even when ``chorusrun`` itself is SIGKILLed.

Theory of operation::

    chorusrun ──Popen (own session, no PDEATHSIG)──> janitor  (python -m chorus.launch.janitor JOB)
        │  its stdin: "<pid>\\n" per rank once they run, "done\\n" after chorusrun's own sweep
        └──> ranks (PDEATHSIG=SIGKILL: they die with chorusrun)

chorus unlinks a segment as soon as every member mapped it, so a job normally leaves
nothing; only a rank 0 killed between creating a segment and unlinking it leaves a file
(``chorus.host.segment``).  chorusrun sweeps such files when the job ends — which it cannot
do when it is SIGKILLed itself: its ranks die with it (PDEATHSIG), possibly inside that
window.  The janitor covers that case.  It reads its stdin until end of file; an end
without ``done`` means chorusrun died without sweeping, so it waits until the ranks it was
told about are gone (at most :data:`RANKS_GONE_S`), sweeps the job's segments and exits.
It runs in its own session, so a signal to chorusrun's process group spares it; it holds
no lock, port or segment, and exits with chorusrun (or right after it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from chorus.host.segment import sweep

#: Seconds the janitor waits for the ranks of a dead launcher to disappear before sweeping.
RANKS_GONE_S = 10.0
DONE = b"done\n"


class Janitor:
    """The launcher's end: start the janitor, tell it the ranks' pids, then that all is clean."""

    def __init__(self, job_id: str):
        try:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-m", "chorus.launch.janitor", job_id], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            print(f"chorusrun: warning: no janitor for /dev/shm ({exc}); if chorusrun is killed "
                  f"with SIGKILL, run chorus.shm.sweep({job_id!r})", file=sys.stderr)
            self._proc = None

    def _send(self, data: bytes) -> None:
        if self._proc is not None:
            try:
                self._proc.stdin.write(data)
                self._proc.stdin.flush()
            except (OSError, ValueError):
                pass  # the janitor died: chorusrun still sweeps when it ends normally

    def watch(self, pids: list[int]) -> None:
        """The ranks to wait for before sweeping, should chorusrun die."""
        self._send(b"".join(b"%d\n" % pid for pid in pids))

    def dismiss(self) -> None:
        """chorusrun swept the job itself: the janitor exits without doing anything."""
        if self._proc is None:
            return
        self._send(DONE)
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass  # it exits on its own; not worth holding chorusrun's exit for


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie counts as gone: it maps nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:  # no such process any more
        return True


def main(argv: list[str]) -> int:
    """Run the janitor for job ``argv[0]``, talking to the launcher over stdin."""
    job_id, data = argv[0], b""
    while chunk := os.read(0, 4096):
        data += chunk
    lines = data.split(b"\n")
    if DONE.rstrip() in lines:
        return 0
    pids = [int(line) for line in lines if line.strip().isdigit()]
    deadline = time.monotonic() + RANKS_GONE_S
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    removed = sweep(job_id)
    if removed:
        try:
            print(f"chorusrun (janitor): the launcher died; removed {len(removed)} shared-memory "
                  f"segment(s) of job {job_id}", file=sys.stderr, flush=True)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
