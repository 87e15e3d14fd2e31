"""chorus's un-held all_reduce beside torch's NCCL in the same processes, as a time series:
at each size, eight batches of 30 back-to-back chorus calls (CUDA events around each
batch, the GPU not held), then NCCL's first all_reduce of that size, then eight batches
more: whether NCCL's set-up at a new size (its connections, with NCCL_RUNTIME_CONNECT=1)
slows chorus's kernels in the batches after it, against NCCL_RUNTIME_CONNECT=0 (every
connection made at init).  One process per GPU; each
rank writes OUT/series-rankR.txt (us per call of each batch).

usage: python3 tools/unheld_after_nccl.py OUT [PORT] [SIZES]   (SIZES: bytes, comma-separated)
"""

from __future__ import annotations

import gc
import os
import sys
import time

import numpy as np
import torch
import torch.multiprocessing as mp

SIZES = (128 << 10, 384 << 10, 512 << 10, 1 << 20, 1536 << 10, 2 << 20, 3 << 20, 4 << 20)


def batch(dist, t, calls: int = 30) -> float:
    """us per call of ``calls`` un-held chorus all_reduces, the ranks lined up first."""
    a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.all_reduce(np.zeros(1), op=dist.ReduceOp.MAX)
    a.record()
    for _ in range(calls):
        dist.all_reduce(t)
    z.record()
    z.synchronize()
    return round(a.elapsed_time(z) * 1e3 / calls, 1)


def body(rank: int, world: int, port: int, out: str, sizes: list[int]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as tdist

    import chorus as dist

    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port + 1}", rank=rank, world_size=world,
                             device_id=torch.device("cuda", rank))
    dist.init_process_group("nccl")
    gc.disable()
    lines = [f"# NCCL_RUNTIME_CONNECT={os.environ.get('NCCL_RUNTIME_CONNECT', '(unset)')}, {world} ranks, "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}"]
    for nbytes in sizes:
        t = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(5):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        before = [batch(dist, t) for _ in range(8)]
        t0 = time.perf_counter()
        tdist.all_reduce(t)
        torch.cuda.synchronize()
        first = (time.perf_counter() - t0) * 1e6
        after = [batch(dist, t) for _ in range(8)]
        lines.append(f"{nbytes >> 10}K: NCCL's first all_reduce of the size took {first:.0f} us; chorus us/call by batch, before {before} "
                     f"after {after}")
    with open(os.path.join(out, f"series-rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()
    tdist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 29811
    sizes = [int(s) for s in sys.argv[3].split(",")] if len(sys.argv) > 3 else list(SIZES)
    mp.spawn(body, args=(torch.cuda.device_count(), port, out, sizes), nprocs=torch.cuda.device_count())
