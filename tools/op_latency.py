"""Per-op latency distribution of a small all_reduce: every call timed on its own, rank 0
prints the mean, percentiles and the main thread's CPU time per call.  Where `chorus bench`
reports a mean over batches, this shows what the mean is made of (a steady floor, or a
tail of slow calls).

usage (from the repository root; ranks over TCP as between hosts):
    CHORUS_TRANSPORT=tcp PYTHONPATH=$PWD python -m chorus.cli run --nproc-per-node 8 \\
        --master-port 0 tools/op_latency.py [--bytes 4] [--iters 5000]

output (one line, rank 0):
    W=8 bytes=4 mean 92.2 p10/50/90/99/99.9 [81.5 86.3 105.4 191.1 343.4] max 451 thread-cpu 92.0 (us)
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import chorus as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=4, help="message size (float32 elements x 4)")
    p.add_argument("--iters", type=int, default=5000, help="timed calls")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls first")
    args = p.parse_args()
    dist.init_process_group("chorus")
    rank, world = dist.get_rank(), dist.get_world_size()
    a = np.ones(max(1, args.bytes // 4), np.float32)
    for _ in range(args.warmup):
        dist.all_reduce(a)
    times = np.empty(args.iters)
    dist.barrier()
    cpu = time.thread_time()
    for i in range(args.iters):
        start = time.perf_counter()
        dist.all_reduce(a)
        times[i] = time.perf_counter() - start
    cpu = (time.thread_time() - cpu) / args.iters * 1e6
    if rank == 0:
        us = times * 1e6
        q = np.round(np.percentile(us, [10, 50, 90, 99, 99.9]), 1)
        print(f"W={world} bytes={a.nbytes} mean {us.mean():.1f} p10/50/90/99/99.9 {q} max {us.max():.0f} "
              f"thread-cpu {cpu:.1f} (us)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
