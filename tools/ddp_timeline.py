"""Where a DDP step's time goes, chorus against NCCL, from torch's profiler: one process per
GPU, the model of ``chorus bench-ddp`` (MLP 4096-8192-8192-1), DDP over backend "chorus"
and over "nccl" (and the same buckets all-reduced back to back, as bench-ddp's
``all_reduce`` variants), steps alternating.  For every profiled step, each rank reports
(microseconds from the step's start): when the backend's all_reduce calls began and how
long the CPU spent in them, when NCCL's kernels began and how long they ran, and the
step's end; then the median of each over the profiled steps.  Each rank writes
OUT/timeline-rankR.txt, rank 0 also one step's whole kernel list per variant.

usage: python3 tools/ddp_timeline.py OUT [STEPS] [PORT]
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch
import torch.multiprocessing as mp

from chorus.bench.ddp import mlp, trainer

VARIANTS = ("ddp nccl", "ddp chorus", "all_reduce nccl", "all_reduce chorus")


def _reducer(flats, group):
    import torch.distributed as dist

    def step(x, y) -> None:
        works = [dist.all_reduce(t, group=group, async_op=True) for t in flats]
        for w in works:
            w.wait()
        torch.cuda.synchronize()

    return step


def _summary(trace: dict) -> tuple[dict, dict]:
    """Per variant, per quantity: the values over the profiled steps; and per variant, one
    step's kernels (name, start, duration)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("step ")]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    calls = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")
             and ("all_reduce" in e["name"] or "allreduce" in e["name"]) and not e["name"].startswith("step ")]
    out: dict = {}
    listing: dict = {}
    for s in steps:
        name, t0, t1 = s["name"][5:], s["ts"], s["ts"] + s["dur"]
        row = out.setdefault(name, {})

        def add(key, value, row=row) -> None:
            row.setdefault(key, []).append(value)

        add("step", s["dur"])
        mine = [k for k in kernels if t0 <= k["ts"] <= t1]
        nccl = [k for k in mine if "nccl" in k["name"].lower()]
        for i, k in enumerate(nccl[:4]):
            add(f"nccl {i} start", k["ts"] - t0)
            add(f"nccl {i} dur", k["dur"])
        if mine:
            add("last kernel end", max(k["ts"] + k["dur"] for k in mine) - t0)
        for i, c in enumerate(sorted((c for c in calls if t0 <= c["ts"] <= t1), key=lambda c: c["ts"])[:4]):
            add(f"all_reduce #{i} start ({c['name'][:28]})", c["ts"] - t0)
            add(f"all_reduce #{i} cpu", c["dur"])
        listing.setdefault(name, [(k["name"][:60], round(k["ts"] - t0, 1), round(k["dur"], 1)) for k in mine])
    return out, listing


def body(rank: int, world: int, port: int, out: str, steps: int) -> None:
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import chorus.torch  # noqa: F401 - registers backend "chorus"

    warnings.filterwarnings("ignore")
    torch.cuda.set_device(rank)
    dist.init_process_group("chorus", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    groups = {"chorus": dist.group.WORLD, "nccl": dist.new_group(backend="nccl")}
    shape = {"features": 4096, "hidden": 8192}
    ddps = {lib: DDP(mlp(shape).cuda(), process_group=g, device_ids=[rank]) for lib, g in groups.items()}
    run = {f"ddp {lib}": trainer(d, d) for lib, d in ddps.items()}
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 4096, generator=gen).cuda()
    y = torch.randn(32, 1, generator=gen).cuda()
    for _ in range(3):  # DDP rebuilds its buckets at the second step
        for name in list(run):
            dist.barrier(group=groups["chorus"])
            run[name](x, y)
    buckets = [b.buffer().numel() for b in ddps["nccl"].reducer._get_zeros_like_grad_buckets()]
    for lib, g in groups.items():
        run[f"all_reduce {lib}"] = _reducer([torch.zeros(n, device="cuda") for n in buckets], g)
        run[f"all_reduce {lib}"](x, y)
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            for name in VARIANTS[i % 4:] + VARIANTS[:i % 4]:
                dist.barrier(group=groups["chorus"])
                torch.cuda.synchronize()
                with record_function(f"step {name}"):
                    run[name](x, y)
    path = os.path.join(out, f"trace-rank{rank}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        summary, listing = _summary(json.load(f))
    os.remove(path)
    lines = [f"rank {rank}: buckets {[4 * n / 2**20 for n in buckets]} MiB; {steps} profiled steps per variant; "
             "median (min-max) us from the step's start"]
    for name in VARIANTS:
        lines.append(f"== {name}")
        for key, values in summary.get(name, {}).items():
            lines.append(f"  {key:48s} {statistics.median(values):9.1f}  ({min(values):.1f}-{max(values):.1f})")
    if rank == 0:
        for name in VARIANTS:
            lines.append(f"== kernels of one step: {name}")
            lines.extend(f"  {k:60s} {t:9.1f} {d:9.1f}" for k, t, d in listing.get(name, []))
    with open(os.path.join(out, f"timeline-rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.barrier(group=groups["chorus"])
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    port = int(sys.argv[3]) if len(sys.argv) > 3 else 29650
    os.makedirs(out, exist_ok=True)
    world = torch.cuda.device_count()
    mp.spawn(body, args=(world, port, out, steps), nprocs=world)


if __name__ == "__main__":
    main()
