"""Where the CPU time of chorus's NCCL hand-off goes (chorus.cuda.nccl): the CPU time per
call (no GPU synchronisation inside the timed loop) of torch's own NCCL all_reduce,
chorus's all_reduce handed to NCCL (``algorithm="nccl"``), chorus's own kernels, and the
hand-off's parts: its ProcessGroupNCCL call, its fingerprint agreement, and the time spent
inside each step of the path (cumulative per call). One process per GPU; 1 MiB bf16, so
that the GPU is never what the loop waits for. Each rank writes OUT/cpucost-rankR.txt.

usage: python3 tools/cuda_handoff_cost.py OUT [PORT]
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp


def per_call(fn, n: int = 200, warmup: int = 20, drained: bool = False):
    """Microseconds of wall time per call of ``fn`` (the CPU's, as the GPU keeps up); with
    ``drained``, also the wall time per call until the GPU has finished them."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    cpu = 1e6 * (t1 - t0) / n
    return (cpu, 1e6 * (time.perf_counter() - t0) / n) if drained else cpu


def timed(owner, name: str, label: str, spent: collections.Counter, seen: dict | None = None) -> None:
    """Wrap ``owner.name`` to add the time spent inside it to ``spent[label]`` (and keep
    the first ``self`` it was called with in ``seen[label]``)."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if seen is not None and args:
            seen.setdefault(label, args[0])
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter_ns() - t0

    setattr(owner, name, wrapper)


def init_both(rank: int, world: int, port: int):
    """torch's NCCL group (on ``port`` + 1) and chorus's (on ``port``) over this rank's GPU;
    returns (torch.distributed, chorus)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch.distributed as tdist

    import chorus as dist

    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port + 1}", rank=rank, world_size=world,
                             device_id=torch.device("cuda", rank))
    dist.init_process_group("nccl")
    return tdist, dist


def body(rank: int, world: int, port: int, out: str) -> None:
    tdist, dist = init_both(rank, world, port)
    import chorus.cuda.component as component
    import chorus.debug.flight as flight
    from chorus.cuda.nccl import NcclPeers, on_current_stream, waited

    t = torch.ones(1 << 19, dtype=torch.bfloat16, device="cuda")
    res: dict[str, float | str] = {}
    res["torch nccl all_reduce"] = per_call(lambda: tdist.all_reduce(t))
    spent: collections.Counter = collections.Counter()
    seen: dict = {}
    for owner, name, label in ((component.CudaComponent, "supports", "supports"),
                               (component.CudaComponent, "check", "check"),
                               (component, "run_in_order", "run_in_order"),
                               (NcclPeers, "agree", "agree"),
                               (NcclPeers, "all_reduce", "NcclPeers.all_reduce"),
                               (flight, "summary", "flight.summary")):
        timed(owner, name, label, spent, seen)
    n = 200
    res["chorus algorithm=nccl"] = per_call(lambda: dist.all_reduce(t, algorithm="nccl"), n)
    for label, ns in spent.items():
        res[f"  in {label}"] = ns / 1e3 / (n + 20)
    res["chorus auto (own kernels)"] = per_call(lambda: dist.all_reduce(t))
    peers = seen.get("agree") or seen["NcclPeers.all_reduce"]
    res["NcclPeers.all_reduce alone"] = per_call(lambda: peers.all_reduce(t, "SUM"))
    group, opts = peers.group(), on_current_stream(tdist.AllreduceOptions())  # (as chorus's synchronous call)
    res["its ProcessGroupNCCL.allreduce+wait"] = per_call(lambda: waited(group.allreduce([t], opts)))
    res["NcclPeers.agree alone"] = per_call(lambda: peers.agree(SimpleNamespace(fingerprint=12345)))
    agree, NcclPeers.agree = NcclPeers.agree, lambda self, call: None
    res["chorus algorithm=nccl, agreement off"] = per_call(lambda: dist.all_reduce(t, algorithm="nccl"), n)
    NcclPeers.agree = agree
    res["threads"] = ", ".join(th.name for th in threading.enumerate())
    with open(os.path.join(out, f"cpucost-rank{rank}.txt"), "w") as f:
        for k, v in res.items():
            f.write(f"{k:40s} {v if isinstance(v, str) else f'{v:8.1f} us/call'}\n")
    dist.destroy_process_group()
    tdist.destroy_process_group()


def spawn_per_gpu(body, port: int) -> None:
    """``body(rank, world, port, out)`` in one process per GPU: OUT is the command line's
    first argument (made if missing), the port its second (default ``port``)."""
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    world = torch.cuda.device_count()
    mp.spawn(body, args=(world, int(sys.argv[2]) if len(sys.argv) > 2 else port, out), nprocs=world)


if __name__ == "__main__":
    spawn_per_gpu(body, 29755)
