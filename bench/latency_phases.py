"""Where a small all_reduce's time goes at W ranks, op by op: each rank runs ``all_reduce``
on a tiny float32 array back to back (as ``bench/latency_loop.py``) with the first sync
(``Sync.arrive_first``) wrapped to stamp its entry and exit, and splits every op into

    pre   the API call up to the sync (checks, plan, lock, publishing the call, copy in)
    wait  the sync itself (reading the other ranks' words until all arrived)
    post  the reduction and the return, and the loop's reset of the array

``LATENCY_CPUS=a,b,...`` pins rank r to the r-th CPU of the list.

Rank 0 prints, per rank, the medians of the three (us) and how many syncs fell back to
the slow path (``settle_first``); the wrapper adds its own call (about 0.1 us to pre).

usage: python3 bench/latency_phases.py W OUTDIR [ELEMENTS] [ITERS]
  e.g. python3 bench/latency_phases.py 8 /tmp/lp 1 20000
Writes OUTDIR/latency_phases.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
from ranks import spawn


def _cpu() -> int:
    """The CPU this process last ran on (field 39 of /proc/self/stat)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def rank_main(rank: int, world: int, n: int, iters: int, outdir: str) -> None:
    import chorus
    from chorus.shm import sync as shm_sync

    if os.environ.get("LATENCY_CPUS"):
        cpus = [int(c) for c in os.environ["LATENCY_CPUS"].split(",")]
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    chorus.init_process_group("chorus", init_method=f"file://{outdir}/chorus.rdzv", rank=rank, world_size=world)
    clock = time.perf_counter_ns
    entered, left, slow = [0] * iters, [0] * iters, [0]
    at = [0]
    plain = shm_sync.Sync.arrive_first

    def stamped(self, seq, fingerprint):
        entered[at[0]] = clock()
        done = plain(self, seq, fingerprint)
        left[at[0]] = clock()
        if not done:
            slow[0] += 1
        return done

    data = np.full(n, rank + 1, np.float32)
    for _ in range(1000):
        chorus.all_reduce(data)
        data[...] = rank + 1
    starts = [0] * (iters + 1)
    shm_sync.Sync.arrive_first = stamped
    chorus.barrier()
    for i in range(iters):
        at[0] = i
        starts[i] = clock()
        chorus.all_reduce(data)
        data[...] = rank + 1
    starts[iters] = clock()
    shm_sync.Sync.arrive_first = plain
    pre = [(entered[i] - starts[i]) / 1e3 for i in range(iters)]
    wait = [(left[i] - entered[i]) / 1e3 for i in range(iters)]
    post = [(starts[i + 1] - left[i]) / 1e3 for i in range(iters)]
    row = {"rank": rank, "op_us": (starts[iters] - starts[0]) / 1e3 / iters,
           "pre_us": statistics.median(pre), "wait_us": statistics.median(wait),
           "post_us": statistics.median(post), "wait_p90_us": sorted(wait)[iters * 9 // 10],
           "slow_syncs": slow[0], "cpu": _cpu()}
    with open(os.path.join(outdir, f"lp-{rank}.json"), "w") as f:
        json.dump(row, f)
    chorus.barrier()
    if rank == 0:
        rows = []
        for r in range(world):
            with open(os.path.join(outdir, f"lp-{r}.json")) as f:
                rows.append(json.load(f))
        print(f"W = {world}, {n} float32, {iters} ops: {rows[0]['op_us']:.2f} us per op on rank 0")
        for x in rows:
            print(f"rank {x['rank']} (cpu {x['cpu']:2d}): pre {x['pre_us']:.2f}  wait {x['wait_us']:.2f} "
                  f"(p90 {x['wait_p90_us']:.2f})  post {x['post_us']:.2f}  slow syncs {x['slow_syncs']}")
        with open(os.path.join(outdir, "latency_phases.json"), "w") as f:
            json.dump(rows, f)
    chorus.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    world, outdir = int(argv[0]), argv[1]
    n = int(argv[2]) if len(argv) > 2 else 1
    iters = int(argv[3]) if len(argv) > 3 else 20000
    return spawn(rank_main, world, outdir, n, iters, outdir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
