"""How fast this host copies memory when W processes copy at once: the ceiling under
every large-message collective and under DDP's gradient copies (docs/benchmarks.md).

usage: python3 tools/membw.py W MIB [ROUNDS]
  e.g. python3 tools/membw.py 8 96 5

Each of W processes copies its own MIB-MiB float32 array into another (numpy, one thread),
all starting together (a multiprocessing barrier) for ROUNDS rounds after one warm-up
round.  Prints, per round, the slowest process's time and the aggregate rate: bytes
read plus bytes written by all processes over that time (a copy of N bytes reads N and
writes N; the write-allocate reads that caches add are not counted).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import time

import numpy as np


def _copier(barrier, results, mib: int, rounds: int) -> None:
    src = np.ones(mib << 18, np.float32)
    dst = np.zeros_like(src)
    times = []
    for r in range(rounds + 1):
        barrier.wait()
        start = time.perf_counter()
        np.copyto(dst, src)
        if r:
            times.append(time.perf_counter() - start)
    results.put(times)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    world, mib = int(argv[0]), int(argv[1])
    rounds = int(argv[2]) if len(argv) == 3 else 5
    if world < 1 or mib < 1 or rounds < 1:
        print("W, MIB and ROUNDS must be at least 1", file=sys.stderr)
        return 2
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_copier, args=(barrier, results, mib, rounds)) for _ in range(world)]
    for p in procs:
        p.start()
    per_proc = [results.get() for _ in procs]
    for p in procs:
        p.join()
    slowest = [max(t[r] for t in per_proc) for r in range(rounds)]
    moved = 2 * world * (mib << 20)
    rates = [moved / s / 1e9 for s in slowest]
    print(f"{world} processes copying {mib} MiB each: slowest {statistics.median(slowest) * 1e3:.1f} ms "
          f"(median of {rounds}), aggregate {statistics.median(rates):.1f} GB/s read + written "
          f"(rounds: {', '.join(f'{r:.1f}' for r in rates)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
