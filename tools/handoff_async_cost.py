"""CPU cost of an async all_reduce that chorus hands to NCCL, as DDP issues it: backend
"chorus" through torch.distributed, ``all_reduce(t, async_op=True)``, ``get_future()``,
``wait()``, one process per GPU, a 1 MiB float32 tensor (``CHORUS_CUDA_NCCL_FROM_BYTES``
set to 1 MiB so that it is a hand-off; small enough that the GPU keeps up).  Per call:
the loop's enqueue time and the time until the GPU has drained it, torch's NCCL group
and chorus's alternating (two rounds each); then rank 0's cProfile of 300 chorus calls
(by own time, then cumulative).  Writes OUT/handoff-async-cost.txt.

usage: python3 tools/handoff_async_cost.py OUT [PORT]
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time

import torch
from cuda_handoff_cost import spawn_per_gpu


def body(rank: int, world: int, port: int, out: str) -> None:
    os.environ["CHORUS_CUDA_NCCL_FROM_BYTES"] = str(1 << 20)
    import torch.distributed as dist

    import chorus.torch  # noqa: F401 - registers backend "chorus"

    torch.cuda.set_device(rank)
    dist.init_process_group("chorus", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    nccl = dist.new_group(backend="nccl")
    t = torch.zeros(1 << 18, device="cuda")

    def one(group) -> None:
        work = dist.all_reduce(t, group=group, async_op=True)
        work.get_future()
        work.wait()

    lines = []
    for name, group in (("nccl", nccl), ("chorus", None), ("nccl", nccl), ("chorus", None)):
        for _ in range(50):
            one(group)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(300):
            one(group)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        lines.append(f"{name}: {1e6 * (t1 - t0) / 300:.1f} us/call enqueue, "
                     f"{1e6 * (time.perf_counter() - t0) / 300:.1f} drained")
    dist.barrier()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(300):
        one(None)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(60)
    if rank == 0:
        with open(os.path.join(out, "handoff-async-cost.txt"), "w") as f:
            f.write("\n".join(lines) + "\n" + text.getvalue())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_per_gpu(body, 29690)
