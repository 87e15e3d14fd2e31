"""What each GPU process of tests/gpu/test_fsdp_cuda.py runs: torch's FSDP2 (``fully_shard``)
over ``init_device_mesh("cuda", (world,))`` with chorus as the torch.distributed backend,
next to a single-GPU copy of the same model trained on the whole batch; then an
all_gather_into_tensor into a view of its output, issued with ``async_op=True`` on a side
stream and waited for on the default stream.  Writes OUT/rankR.json."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as tdist

STEPS = 5
BATCH = 8  # samples per rank


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4)).cuda()


def fsdp(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (world,))
    sharded, single = model(), model()
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    single_opt = torch.optim.SGD(single.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    losses, single_losses = [], []
    for _ in range(STEPS):
        x = torch.randn(BATCH * world, 16, generator=data).cuda()
        y = torch.randn(BATCH * world, 4, generator=data).cuda()
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        loss = torch.nn.functional.mse_loss(sharded(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        tdist.all_reduce(mean, op=tdist.ReduceOp.AVG)  # a CUDA scalar through chorus
        losses.append(mean.item())
        single_loss = torch.nn.functional.mse_loss(single(x), y)
        single_loss.backward()
        single_opt.step()
        single_opt.zero_grad()
        single_losses.append(single_loss.item())
    diffs = [(p.full_tensor() - q).abs().max().item() for p, q in zip(sharded.parameters(), single.parameters(),
                                                                      strict=True)]
    return {"losses": losses, "single_losses": single_losses, "max_param_diff": max(diffs),
            "mesh_backend": str(tdist.get_backend(mesh.get_group()))}


def async_gather_into_view(rank: int, world: int) -> bool:
    """FSDP2's in-place all-gather: the input is this rank's block of the output, the op
    runs on a side stream behind queued work, and the default stream waits on the Work."""
    n = 1 << 20
    out = torch.full((world * n,), -1.0, device="cuda")
    out[rank * n:(rank + 1) * n] = torch.arange(n, device="cuda", dtype=torch.float32) + rank * n
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # the op must wait for this
        work = tdist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n], async_op=True)
    work.wait()  # the default stream waits; the CPU does not
    got = out.clone()  # on the default stream: after the op
    torch.cuda.synchronize()
    return bool(torch.equal(got, torch.arange(world * n, device="cuda", dtype=torch.float32)))


def run(rank: int, world: int, backend: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), NCCL_NVLS_ENABLE="0")
    import chorus.torch  # noqa: F401  (registers backend "chorus")

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls in both runs
    torch.backends.cudnn.allow_tf32 = False
    tdist.init_process_group(backend)
    result = fsdp(rank, world)
    result["gather_into_view"] = async_gather_into_view(rank, world)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    tdist.destroy_process_group()
