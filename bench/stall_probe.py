"""What a small op's mean hides in ``chorus bench``'s harness: W ranks run batches of
back-to-back ops on their own buffers (reset, barrier, the batch, check: as
``chorus.bench.ops.time_case``), timing every op on its own, with the syncs' slow path
(``Sync._wait``: after the first polls, yields, naps) and naps (``Waker.sleep``) counted.

Rank 0 prints per size the mean and median op (us), the ops over 20 us and 200 us
(and where in their batch they fell), and per rank the slow waits, naps and whether the
sync went into sleep-only mode (after slow yields).

Python's garbage collections during the timed batches are counted and timed too.
``STALL_GLOO=1`` also runs torch gloo in the same ranks, the same ops after chorus's at
each size, as ``chorus bench --baseline gloo`` does (needs torch).

usage: python3 bench/stall_probe.py W OUTDIR COLLECTIVE SIZES ITERS
  e.g. python3 bench/stall_probe.py 8 /tmp/sp all_reduce 4,16,64,256,1024 4000
(sizes in bytes).  Writes OUTDIR/stall_probe.json.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

import numpy as np
from ranks import spawn


def rank_main(rank: int, world: int, collective: str, sizes: list[int], iters: int, outdir: str) -> None:
    import chorus
    from chorus.bench.ops import batch_size, make_cases
    from chorus.shm import sync as shm_sync
    from chorus.shm import wake

    chorus.init_process_group("chorus", init_method=f"file://{outdir}/chorus.rdzv", rank=rank, world_size=world)
    gloo = None
    if os.environ.get("STALL_GLOO"):
        import torch.distributed as gloo

        gloo.init_process_group("gloo", init_method=f"file://{outdir}/gloo.rdzv", rank=rank, world_size=world)
    clock = time.perf_counter_ns
    collections: list[int] = []
    gc_started = [0]

    def on_gc(phase, info):
        if phase == "start":
            gc_started[0] = clock()
        else:
            collections.append(clock() - gc_started[0])

    gc.callbacks.append(on_gc)
    waits: list[int] = []
    naps = [0]
    modes = [0]
    plain_wait, plain_sleep = shm_sync.Sync._wait, wake.Waker.sleep

    def timed_wait(self, target, ctx):
        before, start = self.sleep_only_until, clock()
        try:
            return plain_wait(self, target, ctx)
        finally:
            waits.append(clock() - start)
            if self.sleep_only_until != before:
                modes[0] += 1

    def counted_sleep(self, *args):
        naps[0] += 1
        return plain_sleep(self, *args)

    shm_sync.Sync._wait = timed_wait
    wake.Waker.sleep = counted_sleep
    rows = []
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        copies = batch_size(collective, count, "float32", world, iters)
        cases = make_cases(chorus, "chorus", collective, count, "float32", rank, world, "sum", copies)
        for reset, step, _ in cases[:1] * 400:
            reset()
            step()
        chorus.barrier()
        waits.clear()
        collections.clear()
        naps[0] = modes[0] = 0
        times, where, wrong, done = [], [], 0, 0
        while done < iters:
            batch = cases[: iters - done]
            for reset, _, _ in batch:
                reset()
            chorus.barrier()
            for k, (_, step, _) in enumerate(batch):
                start = clock()
                step()
                times.append(clock() - start)
                where.append(k)
            for _, _, check in batch:
                wrong += check()
            done += len(batch)
        us = np.array(times) / 1e3
        rows.append({"bytes": nbytes, "mean_us": float(us.mean()), "median_us": float(np.median(us)),
                     "over20": int((us > 20).sum()), "over200": int((us > 200).sum()),
                     "excess_over20_us": float((us[us > 20] - np.median(us)).sum()),
                     "first_in_batch_over20": int(sum(1 for t, k in zip(us, where, strict=True) if t > 20 and k == 0)),
                     "max_us": float(us.max()), "slow_waits": len(waits),
                     "slow_wait_median_us": statistics.median(waits) / 1e3 if waits else 0.0,
                     "naps": naps[0], "sleep_only_modes": modes[0], "wrong": wrong,
                     "collections": len(collections), "collection_ms": sum(collections) / 1e6})
        if gloo is not None:
            for reset, step, _ in make_cases(gloo, "gloo", collective, count, "float32", rank, world, "sum",
                                             copies)[:1] * min(iters, 2000):
                reset()
                step()
    with open(os.path.join(outdir, f"sp-{rank}.json"), "w") as f:
        json.dump(rows, f)
    shm_sync.Sync._wait, wake.Waker.sleep = plain_wait, plain_sleep
    gc.callbacks.remove(on_gc)
    chorus.barrier()
    if rank == 0:
        _report(world, iters, outdir)
    if gloo is not None:
        gloo.destroy_process_group()
    chorus.destroy_process_group()


def _report(world: int, iters: int, outdir: str) -> None:
    ranks = []
    for r in range(world):
        with open(os.path.join(outdir, f"sp-{r}.json")) as f:
            ranks.append(json.load(f))
    for i, row in enumerate(ranks[0]):
        print(f"{row['bytes']:6d} B: mean {row['mean_us']:.2f} us, median {row['median_us']:.2f}, "
              f"{row['over20']} ops > 20 us ({row['first_in_batch_over20']} first in batch), "
              f"{row['over200']} > 200 us, max {row['max_us']:.0f}; their excess {row['excess_over20_us'] / iters:.2f} us/op")
        for r in range(world):
            x = ranks[r][i]
            print(f"    rank {r}: slow waits {x['slow_waits']} (median {x['slow_wait_median_us']:.1f} us), "
                  f"naps {x['naps']}, sleep-only modes {x['sleep_only_modes']}, wrong {x['wrong']}, "
                  f"GC {x['collections']} ({x['collection_ms']:.2f} ms)")
    with open(os.path.join(outdir, "stall_probe.json"), "w") as f:
        json.dump(ranks, f)


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    world, outdir, collective = int(argv[0]), argv[1], argv[2]
    sizes, iters = [int(s) for s in argv[3].split(",")], int(argv[4])
    return spawn(rank_main, world, outdir, collective, sizes, iters, outdir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
