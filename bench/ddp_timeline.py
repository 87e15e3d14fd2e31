"""Where a DDP step on chorus spends its time: one rank's timeline, step by step.

Trains chorus bench-ddp's MLP (2048-4096-4096-1, batch 8 per rank) with DDP on the
"chorus" backend and records, relative to each step's start: the end of the forward
pass, each bucket's all_reduce as DDP issues it, as chorus's shared-memory op starts and
ends (chorus.shm.collectives.all_reduce, on the group's worker thread), the end of
``loss.backward()`` (DDP has waited for its buckets and copied them out) and the end of
the optimizer step.  Rank 0 prints the medians over the timed steps (ms).

usage: python3 bench/ddp_timeline.py W STEPS [THREADS]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time


def rank_main(rank: int, world: int, steps: int, threads: int, workdir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import chorus.shm.collectives as shm_collectives
    import chorus.torch  # noqa: F401
    from chorus.torch import backend

    torch.set_num_threads(threads)
    dist.init_process_group("chorus", init_method=f"file://{workdir}/rdzv", rank=rank, world_size=world)
    events: list[tuple[str, float]] = []
    issue, run = backend.ChorusProcessGroup.allreduce, shm_collectives.all_reduce

    def issued(self, tensors, opts=None):
        events.append((f"issue {tensors[0].nbytes >> 20}M", time.perf_counter()))
        return issue(self, tensors, opts)

    def running(win, sync, ctx, data, *args, **kwargs):
        events.append((f"start {data.nbytes >> 20}M", time.perf_counter()))
        try:
            return run(win, sync, ctx, data, *args, **kwargs)
        finally:
            events.append((f"end {data.nbytes >> 20}M", time.perf_counter()))

    backend.ChorusProcessGroup.allreduce, shm_collectives.all_reduce = issued, running
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                    torch.nn.ReLU(), torch.nn.Linear(4096, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    rows: list[dict[str, float]] = []
    for i in range(steps + 3):
        x, y = torch.randn(8, 2048, generator=data), torch.randn(8, 1, generator=data)
        dist.barrier()
        events.clear()
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        events.append(("forward", time.perf_counter()))
        opt.zero_grad()
        loss.backward()
        events.append(("backward", time.perf_counter()))
        opt.step()
        events.append(("step", time.perf_counter()))
        if i >= 3:
            rows.append({name: (t - t0) * 1e3 for name, t in events})
    if rank == 0:
        for name in rows[-1]:
            print(f"{name:12s} {statistics.median(r[name] for r in rows if name in r):8.1f} ms")
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    import torch.multiprocessing as mp

    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    world, steps = int(argv[0]), int(argv[1])
    threads = int(argv[2]) if len(argv) == 3 else max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(rank_main, args=(world, steps, threads, workdir), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
