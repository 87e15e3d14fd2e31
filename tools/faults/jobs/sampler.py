"""A rank's own threads and descriptors over time (a daemon thread), and how long each
``chorus-admit-*`` thread (one incoming connection's handshake) lived."""

from __future__ import annotations

import os
import threading
import time


class Sampler:
    def __init__(self, period: float = 0.1):
        self.period = period
        self.start = time.monotonic()
        self.samples: list[tuple[float, int, int, int]] = []  # (seconds, threads, admit threads, descriptors)
        self.admit: dict[threading.Thread, list[float]] = {}  # thread -> [first seen, last seen]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic() - self.start
            alive = threading.enumerate()
            admitting = [t for t in alive if t.name.startswith("chorus-admit-")]
            for t in admitting:
                self.admit.setdefault(t, [now, now])[1] = now
            self.samples.append((round(now, 2), len(alive), len(admitting), _descriptors()))
            self._stop.wait(self.period)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        lives = [last - first for first, last in self.admit.values()]
        every_second, next_at = [], 0.0
        for s in self.samples:
            if s[0] >= next_at:
                every_second.append(s)
                next_at = s[0] + 1.0
        return {"admit_threads": len(lives), "admit_longest_s": round(max(lives, default=0.0), 2),
                "most_threads": max((s[1] for s in self.samples), default=0),
                "most_admit_threads": max((s[2] for s in self.samples), default=0),
                "most_descriptors": max((s[3] for s in self.samples), default=0),
                "samples_every_second": every_second}


def _descriptors() -> int:
    """This process's open descriptors (-1 while it has none left to list them with)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1
