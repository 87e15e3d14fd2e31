"""The parts of chorus's NCCL hand-off (chorus.cuda.component, chorus.cuda.nccl), each
timed alone and together, one process per GPU, 1 MiB bf16 all_reduce: CPU time per call
(the loop's enqueue), wall time per call (the loop and the GPU's drain) and GPU time per
call (CUDA events around back-to-back calls, the GPU held while the CPU enqueues).  Rows:
torch's own NCCL; chorus handed to NCCL (the barrier in front, CHORUS_CUDA_NCCL_AGREE=gpu);
the hand-off's ProcessGroupNCCL alone, with and without wait(); the workspace barrier
alone and with it; the same against torch's default group; the CPU agreement instead of
the barrier; chorus's own kernels; and 16 MiB both ways.  Reads the component's private
state (its NcclPeers, lanes and guard switch): a diagnostic, not an API.  Each rank writes
OUT/p3-rankR.txt.

usage: python3 tools/cuda_handoff_parts.py OUT [PORT]
"""

from __future__ import annotations

import os

import torch
from cuda_handoff_cost import init_both, per_call, spawn_per_gpu


def gpu_call(fn, n: int = 300, held: bool = True) -> float:
    """GPU us per call: events around ``n`` calls queued behind a 0.2 s hold (not
    ``held``: run as they are enqueued, so the longer of CPU and GPU time per call)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    if held:
        torch.cuda._sleep(int(0.2 * 1.98e9))
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def body(rank: int, world: int, port: int, out: str) -> None:

    from chorus.api.state import current
    from chorus.components.select import device_component
    from chorus.cuda.nccl import on_current_stream, waited

    tdist, dist = init_both(rank, world, port)
    t = torch.ones(1 << 19, dtype=torch.bfloat16, device="cuda")
    lines = []

    def row(name, fn) -> None:
        c, w = per_call(fn, 300, 30, drained=True)
        g = gpu_call(fn)
        lines.append(f"{name:44s} cpu {c:7.1f}  wall {w:7.1f}  gpu {g:7.1f} us/call")

    row("torch nccl", lambda: tdist.all_reduce(t))
    row("chorus nccl (guard)", lambda: dist.all_reduce(t, algorithm="nccl"))
    comp = device_component(current().default_group, "cuda")
    pg = comp._nccl.group()
    default = tdist.distributed_c10d._get_default_group()
    opts = on_current_stream(tdist.AllreduceOptions())  # (as chorus's synchronous call and torch's own)
    row("its PG allreduce+wait", lambda: waited(pg.allreduce([t], opts)))
    row("its PG allreduce, no wait", lambda: pg.allreduce([t], opts))
    lanes = comp.lanes

    def barrier() -> None:
        lanes.begin(1, None, torch.cuda.current_stream().cuda_stream, "", "", 77)
        lanes.barrier()

    def barrier_then(group) -> None:
        barrier()
        waited(group.allreduce([t], opts))

    row("lanes barrier alone", barrier)
    row("barrier + PG allreduce+wait", lambda: barrier_then(pg))
    row("torch PG allreduce+wait", lambda: waited(default.allreduce([t], opts)))
    row("barrier + torch PG allreduce+wait", lambda: barrier_then(default))
    comp._nccl_guard = False  # the CPU agreement instead (CHORUS_CUDA_NCCL_AGREE=cpu)
    row("chorus nccl (cpu agree)", lambda: dist.all_reduce(t, algorithm="nccl"))
    row("chorus auto (own kernels)", lambda: dist.all_reduce(t))
    x = torch.ones(8 << 20, dtype=torch.bfloat16, device="cuda")
    comp._nccl_guard = True
    row("16 MiB chorus (guard)", lambda: dist.all_reduce(x))
    row("16 MiB torch nccl", lambda: tdist.all_reduce(x))
    with open(os.path.join(out, f"p3-rank{rank}.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    dist.destroy_process_group()
    tdist.destroy_process_group()


if __name__ == "__main__":
    spawn_per_gpu(body, 29855)
