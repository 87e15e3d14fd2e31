"""What each GPU process of tests/gpu/test_cuda_hosts.py runs: with ``CHORUS_HOST_ID=a,a,b,b``
(two simulated hosts of two GPUs), ``import chorus as dist; dist.init_process_group("nccl")``
and torch's NCCL side by side; the first CUDA call must find the CUDA component staging
through pinned host memory (members on several hosts never map each other) and the
world group hierarchical; then tests/gpu/api_workers.py's seeded random program of every
collective and point-to-point op (sub-group [1, 3] spans both hosts too), each result
compared bit for bit with NCCL's.  Writes OUT/rankR.json."""

from __future__ import annotations

import json
import os

import api_workers
import torch
import torch.distributed as tdist

import chorus as dist
from chorus.api.state import current


def run(rank: int, world: int, port: int, steps: int, seed: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port + 1}", rank=rank, world_size=world,
                             device_id=torch.device("cuda", rank))
    dist.init_process_group("nccl")
    x = torch.full((1000,), float(rank + 1), device="cuda")
    dist.all_reduce(x)  # attaches the world group's CUDA component
    pg = current().default_group
    comp = pg.device_components["cuda"]
    facts = {"staged": comp.lanes is None, "reason": comp.staging_reason, "hierarchical": pg.hierarchy is not None,
             "first_sum_right": bool((x == sum(range(1, world + 1))).all()), "component": type(comp).__name__,
             "rails": getattr(comp, "kind", None),
             # (that first all_reduce, on the whole group's NCCL communicator: made now)
             "first_all_reduce_flat": getattr(getattr(comp, "flat", None), "nccl", None) is not None}
    prog = api_workers.Program(rank, world, seed)
    for i in range(steps):
        prog.step(i)
    torch.cuda.synchronize()
    y = torch.full((1 << 16,), float(rank + 1), device="cuda")  # 256 KiB
    dist.all_reduce(y)
    torch.cuda.synchronize()
    facts["second_sum_right"] = bool((y == sum(range(1, world + 1))).all())
    z = torch.empty(4 * world, device="cuda")
    dist.all_gather_into_tensor(z, torch.full((4,), float(rank), device="cuda"))
    torch.cuda.synchronize()
    facts["gather_right"] = z.tolist() == [float(r) for r in range(world) for _ in range(4)]
    facts["wrong"] = prog.wrong
    host = getattr(comp, "host_peers", None)
    facts["host_nccl"] = host is not None and host.nccl is not None  # a host phase ran on NCCL
    flat = getattr(comp, "flat", None)
    facts["flat_nccl"] = flat is not None and flat.nccl is not None  # some op ran on the whole group's NCCL
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    dist.destroy_process_group()
    tdist.destroy_process_group()
