"""How late the ranks that waited long leave a barrier after the last rank arrived: the
cost of a waiter that naps in a sync (chorus.shm.wake).

usage: python3 bench/wake_lag.py W ITERS DELAY_S OUTDIR
  e.g. python3 bench/wake_lag.py 8 100 0.01 /tmp/wl

The last rank sleeps DELAY_S before each of ITERS barriers and notes when it arrives;
the others note when they leave.  Prints the median, 90th percentile and maximum of
(leave - arrival) over every other rank and barrier, in us (one clock: CLOCK_MONOTONIC).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from ranks import spawn


def rank_main(rank: int, world: int, iters: int, delay: float, outdir: str) -> None:
    import chorus

    chorus.init_process_group("chorus", init_method=f"file://{outdir}/chorus.rdzv", rank=rank, world_size=world)
    for _ in range(20):
        chorus.barrier()
    times = []
    for _ in range(iters):
        if rank == world - 1:
            time.sleep(delay)
            times.append(time.perf_counter())
            chorus.barrier()
        else:
            chorus.barrier()
            times.append(time.perf_counter())
    with open(os.path.join(outdir, f"times-{rank}.json"), "w") as f:
        json.dump(times, f)
    chorus.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    world, iters, delay, outdir = int(argv[0]), int(argv[1]), float(argv[2]), argv[3]
    code = spawn(rank_main, world, outdir, iters, delay, outdir)
    if code:
        return code

    def load(rank: int) -> list[float]:
        with open(os.path.join(outdir, f"times-{rank}.json")) as f:
            return json.load(f)

    arrivals = load(world - 1)
    lags = sorted((left - arrived) * 1e6 for r in range(world - 1) for left, arrived in zip(load(r), arrivals, strict=True))
    print(f"leave after the last arrival, us: median {statistics.median(lags):.0f} "
          f"p90 {lags[int(0.9 * len(lags))]:.0f} max {lags[-1]:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
