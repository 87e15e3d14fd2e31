"""Where the CPU time of one eager chorus all_reduce on its own kernels goes (a small
bf16 message, one process per GPU), against torch's NCCL in the same processes.

Rows (CPU us per call, perf_counter around back-to-back calls, each row's best of 3):
torch's NCCL; chorus.all_reduce; the CUDA component's all_reduce_now; the time per call
un-held (CUDA events around back-to-back eager calls: the longer of CPU and GPU); both
again with the lane's CUDA-graph replays (chorus.cuda.replays) off and on, alternating,
twice; then chorus.all_reduce with timing wrappers around the layers below it
(Lanes.replay_kept, the steady state's graph launch, and where it steps aside Lanes.shot, its
Replays (graph launches), the Shot,
chorus.cuda.direct's parameter block and its cuLaunchKernel call, chorus.cuda.launchers.launch
where a launch goes through it), each layer's share of a call; the lane's per-call
queries of torch and the CUDA runtime, each alone; all_gather_into_tensor and
reduce_scatter_tensor (COUNT elements a rank) against NCCL's, CPU and un-held; last, chorus.all_reduce
with the launches stubbed out and replays off (chorus's Python alone; the group is then out of step, so
this row is the last thing the ranks do).  Wraps module attributes and reads the
component's private state: a diagnostic, not an API.  Each rank writes OUT/lane-rankR.txt.

usage: python3 tools/cuda_lane_cost.py OUT [PORT] [COUNT]
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

import torch
from cuda_handoff_cost import init_both, spawn_per_gpu, timed
from cuda_handoff_parts import gpu_call

COUNT = int(sys.argv[3]) if len(sys.argv) > 3 else 1024


def cpu_per_call(fn, n: int = 3000, rounds: int = 3) -> float:
    """Best of ``rounds`` of CPU us per call over ``n`` calls (the GPU keeps up: small ops)."""
    best = float("inf")
    for _ in range(rounds):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return best * 1e6


def body(rank: int, world: int, port: int, out: str) -> None:
    tdist, dist = init_both(rank, world, port)
    import gc

    from chorus.api.state import current
    from chorus.cuda import launchers

    t = torch.ones(COUNT, dtype=torch.bfloat16, device="cuda")
    dist.all_reduce(t)  # (the group's CUDA component is made by its first CUDA op)
    comp = current().default_group.device_components["cuda"]
    op = dist.ReduceOp.SUM
    rows: list[tuple[str, float]] = []
    gc.disable()
    for _ in range(2):
        rows.append(("torch nccl all_reduce", cpu_per_call(lambda: tdist.all_reduce(t))))
        rows.append(("chorus.all_reduce", cpu_per_call(lambda: dist.all_reduce(t))))
        rows.append(("component.all_reduce_now", cpu_per_call(lambda: comp.all_reduce_now(t, op))))
    rows.append(("un-held GPU us/call: torch nccl", gpu_call(lambda: tdist.all_reduce(t), 3000, held=False)))
    rows.append(("un-held GPU us/call: chorus", gpu_call(lambda: dist.all_reduce(t), 3000, held=False)))
    lanes = comp.lanes
    for _ in range(2):  # replays (chorus.cuda.replays) off and on, alternating
        for on in (False, True):
            lanes.replay = on
            for shot in lanes.shots.values():
                shot.replays = None if on else False
            which = "on" if on else "off"
            rows.append((f"chorus.all_reduce, replays {which}", cpu_per_call(lambda: dist.all_reduce(t))))
            rows.append((f"un-held GPU us/call: chorus, replays {which}",
                         gpu_call(lambda: dist.all_reduce(t), 3000, held=False)))

    # the lane's per-call queries, alone (each a C call into torch or the CUDA runtime)
    torch_c, dev, raw = torch._C, torch.cuda.current_device(), comp._last_raw
    for label, fn in (("  torch: _cuda_isCurrentStreamCapturing", torch_c._cuda_isCurrentStreamCapturing),
                      ("  torch: _cuda_getDevice", torch_c._cuda_getDevice),
                      ("  torch: _cuda_getCurrentRawStream", lambda: torch_c._cuda_getCurrentRawStream(dev)),
                      ("  torch: tensor.shape", lambda: t.shape),
                      ("  torch: is_contiguous + get_device + data_ptr",
                       lambda: (t.is_contiguous(), t.get_device(), t.data_ptr())),
                      ("  component.check", lambda: comp.check("all_reduce")),
                      ("  component._inline", lambda: comp._inline(raw))):
        rows.append((label, cpu_per_call(fn, 20000)))
    # all_gather_into_tensor / reduce_scatter_tensor through the lane (rows_now), replays on
    part = torch.ones(COUNT, dtype=torch.bfloat16, device="cuda")
    blocks = torch.ones(world * COUNT, dtype=torch.bfloat16, device="cuda")
    for name, nccl, mine in (
            ("all_gather", lambda: tdist.all_gather_into_tensor(blocks, part),
             lambda: dist.all_gather_into_tensor(blocks, part)),
            ("reduce_scatter", lambda: tdist.reduce_scatter_tensor(part, blocks),
             lambda: dist.reduce_scatter_tensor(part, blocks))):
        rows.append((f"torch nccl {name}", cpu_per_call(nccl)))
        rows.append((f"chorus {name}", cpu_per_call(mine)))
        rows.append((f"un-held GPU us/call: torch nccl {name}", gpu_call(nccl, 3000, held=False)))
        rows.append((f"un-held GPU us/call: chorus {name}", gpu_call(mine, 3000, held=False)))

    spent: collections.Counter = collections.Counter()
    from chorus.cuda.direct import Block, DirectLaunch
    from chorus.cuda.lanes import Lanes

    dist.all_reduce(t)
    from chorus.cuda.replays import Replays

    graphs = lanes.graphs  # (the replays' driver: its launch is the ctypes cuGraphLaunch)
    layers = ((Lanes, "replay_kept", "Lanes.replay_kept (steady state)"),
              *(((graphs, "launch", "cuGraphLaunch"),) if graphs is not None else ()),
              (Lanes, "shot", "Lanes.shot"), (Replays, "__call__", "Replays.__call__ (cuGraphLaunch)"),
              (launchers.Shot, "__call__", "Shot.__call__"),
              (DirectLaunch, "__call__", "DirectLaunch.__call__ (not a Shot's)"),
              (Block, "__call__", "Block.__call__ (cuLaunchKernel)"), (launchers, "launch", "launchers.launch"))
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in layers]
    for owner, name, label in layers:
        timed(owner, name, label, spent)
    n = 3000
    whole = cpu_per_call(lambda: dist.all_reduce(t), n, rounds=1)
    calls = n + 50
    rows.append(("wrapped chorus.all_reduce", whole))
    for label, ns in spent.items():
        rows.append((f"  in {label}", ns / 1e3 / calls))
    for owner, name, fn in originals:
        setattr(owner, name, fn)
    torch.cuda.synchronize()
    tdist.barrier()
    lanes.replay = False
    for shot in lanes.shots.values():
        shot.replays = False
    launchers.launch = lambda *a, **k: None
    Block.__call__ = lambda self, grid, stream: None
    rows.append(("chorus.all_reduce, launch stubbed", cpu_per_call(lambda: dist.all_reduce(t), rounds=2)))
    with open(os.path.join(out, f"lane-rank{rank}.txt"), "w") as f:
        f.write(f"# {COUNT} bf16 elements, {world} ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
        with open("/proc/self/stat") as stat:
            cpu_now = stat.read().rsplit(")", 1)[1].split()[36]
        f.write(f"# CPUs allowed {len(os.sched_getaffinity(0))}, on CPU {cpu_now}; threads: "
                f"{', '.join(th.name for th in threading.enumerate())}\n")
        for k, v in rows:
            f.write(f"{k:44s} {v:8.2f} us/call\n")
    tdist.barrier()  # (torch's group: no rank leaves while another still times the stubbed calls)
    torch.cuda.synchronize()
    os._exit(0)  # (chorus's group is out of step after the stubbed launches: no teardown)


if __name__ == "__main__":
    spawn_per_gpu(body, 29791)
