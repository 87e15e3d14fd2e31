"""``chorus bench``'s progress: a line per size as it finishes, while the ranks run.

Rank 0 of each job (chorus with its gloo baseline; MPI in its own job; the CUDA ranks)
appends a record to ``<workdir>/progress-<job>.jsonl`` once it has timed a size
(:func:`record`): the size's index and each library's mean time there.  The parent reads
those files while it waits for the ranks (:meth:`Progress.poll`) and, for each size that
every job has finished, prints::

    # [3/8] 1K: chorus 12.3 us, gloo 150.2 us (12.21x), mpi 80.0 us (6.50x); 4.2 s

On a terminal the line is rewritten in place and cleared before the table; otherwise
each size gets a line of its own (a ``#`` comment, like the run's other notes, so the
output still parses as the table plus comments).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from typing import TextIO

from chorus.bench.sizes import human


def _path(workdir: str, job: str) -> str:
    return os.path.join(workdir, f"progress-{job}.jsonl")


def record(workdir: str, job: str, index: int, seconds: dict[str, float]) -> None:
    """Rank 0 of ``job`` finished size ``index`` (1-based) with these mean times per
    library (seconds per op).  One ``write`` of one line, so a reader sees it whole or not."""
    line = json.dumps({"index": index, "seconds": seconds}) + "\n"
    with open(_path(workdir, job), "a") as f:
        f.write(line)


class Progress:
    """Prints sizes as every job in ``jobs`` finishes them (``sizes``: bytes per index)."""

    def __init__(self, workdir: str, jobs: list[str], sizes: list[int], stream: TextIO | None = None,
                 live: bool | None = None):
        self.workdir = workdir
        self.jobs = list(jobs)
        self.sizes = sizes
        self.stream = stream if stream is not None else sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.started = time.monotonic()
        self._read = {job: 0 for job in jobs}  # bytes of each file already taken
        self._times: dict[int, dict[str, dict[str, float]]] = {}  # index -> job -> library -> s
        self._shown = 0  # sizes printed so far (in order)
        self._drawn = False  # a live line is on the screen

    def waiting(self, what: str) -> None:
        """On a terminal, say what the run waits for until the first size is done."""
        if self.live:
            self.stream.write("\r\033[K" + what[: shutil.get_terminal_size().columns - 1])
            self.stream.flush()
            self._drawn = True

    def drop(self, job: str) -> None:
        """``job`` stopped (its failure is reported elsewhere): no size waits for it any more."""
        if job in self.jobs:
            self.jobs.remove(job)
        self.poll()

    def poll(self) -> None:
        """Read what the jobs recorded since the last call; print the sizes now finished."""
        for job in self.jobs:
            for entry in self._new_records(job):
                self._times.setdefault(entry["index"], {})[job] = entry["seconds"]
        while self._shown < len(self.sizes):
            done = self._times.get(self._shown + 1, {})
            if not self.jobs or any(job not in done for job in self.jobs):
                break
            self._shown += 1
            self._show(self._shown, {lib: s for job in self.jobs for lib, s in done[job].items()})

    def close(self) -> None:
        """The run ended: take the last records, and clear the live line for the table."""
        self.poll()
        if self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False

    def _new_records(self, job: str) -> list[dict]:
        try:
            with open(_path(self.workdir, job), "rb") as f:
                f.seek(self._read[job])
                data = f.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._read[job] += len(whole)
        return [json.loads(line) for line in whole.splitlines() if line.strip()]

    def _show(self, index: int, seconds: dict[str, float]) -> None:
        self.stream.write(self.line(index, seconds))
        self.stream.flush()

    def line(self, index: int, seconds: dict[str, float]) -> str:
        """What is printed for size ``index`` (with its line ending, or the live rewrite)."""
        parts = []
        mine = seconds.get("chorus")
        for lib, s in sorted(seconds.items(), key=lambda item: item[0] != "chorus"):
            text = f"{lib} {s * 1e6:.1f} us"
            if lib != "chorus" and mine:
                text += f" ({s / mine:.2f}x)"
            parts.append(text)
        n = len(self.sizes)
        text = (f"[{index}/{n}] {human(self.sizes[index - 1])}: {', '.join(parts)}; "
                f"{time.monotonic() - self.started:.1f} s")
        if not self.live:
            return f"# {text}\n"
        self._drawn = True
        width = shutil.get_terminal_size().columns - 1  # a wrapped line could not be rewritten
        return f"\r\033[K{text[:width]}"
