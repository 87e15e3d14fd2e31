"""What the ranks of chorus.torch's test jobs run for training (tests/test_torch_backend.py
starts the jobs and asserts): DDP on chorus against DDP on gloo (and its variants), a
tensor reused by all_reduce moving into shared memory, FSDP2 against a single-process run,
DTensor redistributions, distributed checkpoints across backends, DeviceMesh groups."""

from __future__ import annotations

import torch
import torch.distributed as tdist

F32 = torch.float32

# -- DDP -------------------------------------------------------------------------------------
class MLP(torch.nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)
        self.spare = torch.nn.Linear(32, 4) if unused else None

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def train(rank, group, steps, unused=False, no_sync=False, hook=None, wide=False, **ddp_kwargs):
    """Train a seeded MLP with DDP on ``group``; return (per-step losses, final parameters).
    ``wide``: a first layer of 16 x 32768 (2 MiB of gradients: buckets that chorus moves into
    shared memory, chorus.torch.sharing)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32768), torch.nn.ReLU(), torch.nn.Linear(32768, 4)) \
        if wide else MLP(unused)
    model = DDP(net, process_group=group, find_unused_parameters=unused, **ddp_kwargs)
    if hook is not None:
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.002 if wide else 0.05)  # (0.05 makes the wide one diverge)
    data = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        if no_sync:
            with model.no_sync():
                torch.nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
            x, y = x[4:], y[4:]
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def ddp_vs_gloo(rank, world, gloo, steps):
    mine, mine_params = train(rank, None, steps)
    theirs, their_params = train(rank, gloo, steps)
    everyone = [None] * world
    tdist.all_gather_object(everyone, mine_params)
    return {"losses": mine, "gloo_losses": theirs,
            "params_equal_gloo": max((a - b).abs().max().item() for a, b in zip(mine_params, their_params, strict=True)),
            "identical_across_ranks": all(torch.equal(a, b) for other in everyone for a, b in zip(other, mine_params, strict=True))}


def ddp_variant(rank, world, gloo, variant):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    kwargs = {"bucket_view": {"gradient_as_bucket_view": True}, "unused": {"unused": True},
              "no_sync": {"no_sync": True}, "fp16_hook": {"hook": default_hooks.fp16_compress_hook}}[variant]
    mine, mine_params = train(rank, None, 3, **kwargs)
    theirs, their_params = train(rank, gloo, 3, **kwargs)
    return {"losses": mine, "gloo_losses": theirs,
            "max_param_diff": max((a - b).abs().max().item() for a, b in zip(mine_params, their_params, strict=True))}


def shared_buckets(rank, world, gloo):
    """A tensor all-reduced again and again moves into shared memory at its second
    all_reduce (views follow it) and then takes the mapped path; DDP with buckets that move
    trains like gloo."""
    from chorus.shm import mapped

    taken, real = [], mapped.all_reduce
    mapped.all_reduce = lambda win, *args: taken.append(1) or real(win, *args)
    try:
        t = torch.zeros(3 << 18)  # 3 MiB: more than a slot (2 MiB at W = 2, where a message that fits one is one-shot)
        view = t[5:10]
        right = []
        for i in range(3):
            t.fill_(rank + 1 + i)
            tdist.all_reduce(t, async_op=True).wait()
            want = sum(r + 1 + i for r in range(world))
            right.append(bool((t == want).all()) and bool((view == want).all()))
        shared, direct_ops = t.untyped_storage().is_shared(), len(taken)
        import numpy as np

        backing = np.zeros(1 << 19, np.float32)  # a tensor over numpy's memory is never moved: it stays an alias
        aliased = torch.from_numpy(backing)
        for _ in range(3):
            aliased.fill_(1.0)
            tdist.all_reduce(aliased)
        numpy_alias = bool((backing == world).all()) and not aliased.untyped_storage().is_shared()
        fresh = []  # a new tensor each time (often at the same address) is not reused: never moved
        for _ in range(3):
            u = torch.ones(1 << 18)
            tdist.all_reduce(u)
            fresh.append(u.untyped_storage().is_shared())
            del u
        a2a_in = torch.arange(world * (1 << 20), dtype=F32) + rank * 1e7  # 4 MiB to every rank
        a2a_ok = []
        for _ in range(3):
            out = torch.empty_like(a2a_in)
            tdist.all_to_all_single(out, a2a_in)
            want = torch.cat([torch.arange(rank << 20, (rank + 1) << 20, dtype=F32) + q * 1e7 for q in range(world)])
            a2a_ok.append(torch.equal(out, want))
        a2a_shared = a2a_in.untyped_storage().is_shared()
        mine, mine_params = train(rank, None, 4, wide=True)
        theirs, their_params = train(rank, gloo, 4, wide=True)
    finally:
        mapped.all_reduce = real
    return {"right": right, "shared": shared, "fresh_shared": fresh, "mapped_ops": direct_ops,
            "a2a_ok": a2a_ok, "a2a_shared": a2a_shared, "numpy_alias": numpy_alias, "ddp_mapped_ops": len(taken) - direct_ops,
            "losses": mine, "gloo_losses": theirs,
            "max_param_diff": max((a - b).abs().max().item() for a, b in zip(mine_params, their_params, strict=True))}


# -- FSDP2, DTensor, checkpoints, DeviceMesh -------------------------------------------------
def fsdp_model(mesh=None):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2(rank, world):
    """FSDP2 on every rank vs one process training on the whole batch."""
    model = fsdp_model()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(5):
        x, y = torch.randn(4 * world, 8, generator=data), torch.randn(4 * world, 4, generator=data)
        loss = torch.nn.functional.mse_loss(model(x[4 * rank: 4 * rank + 4]), y[4 * rank: 4 * rank + 4])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        tdist.all_reduce(mean, op=tdist.ReduceOp.AVG)
        losses.append(mean.item())
        ref_loss = torch.nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    diff = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    return {"losses": losses, "ref_losses": ref_losses, "max_param_diff": diff}


def dtensor(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(4 * world, 2 * world, generator=torch.Generator().manual_seed(3))
    d = distribute_tensor(full, mesh, [Shard(0)])
    rep = d.redistribute(mesh, [Replicate()])
    col = rep.redistribute(mesh, [Shard(1)])
    back = col.redistribute(mesh, [Shard(0)])
    return {"replicate_exact": torch.equal(rep.to_local(), full), "shard1_exact": torch.equal(col.full_tensor(), full),
            "round_trip_exact": torch.equal(back.to_local(), d.to_local()) and torch.equal(back.full_tensor(), full),
            "mesh_backend": tdist.get_backend(mesh.get_group())}


def checkpoint(rank, world, gloo, workdir):
    """A sharded (FSDP2) state dict saved under chorus loads under gloo, and the reverse."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh

    gloo_mesh = DeviceMesh.from_group(gloo, "cpu")
    out = {}
    for name, save_mesh, save_pg, load_mesh, load_pg in (("chorus_to_gloo", None, None, gloo_mesh, gloo),
                                                         ("gloo_to_chorus", gloo_mesh, gloo, None, None)):
        saved = fsdp_model(save_mesh)
        with torch.no_grad():
            for i, p in enumerate(saved.parameters()):
                p.to_local().add_(i + 1.5)
        dcp.save(saved.state_dict(), checkpoint_id=f"{workdir}/{name}", process_group=save_pg)
        loaded = fsdp_model(load_mesh)
        state = loaded.state_dict()
        dcp.load(state, checkpoint_id=f"{workdir}/{name}", process_group=load_pg)
        loaded.load_state_dict(state)
        out[name] = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(saved.parameters(), loaded.parameters(), strict=True))
        out[name + "_sharded"] = type(state["0.weight"]).__name__
    return out


def device_mesh(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from chorus.mesh import dim_groups

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    grid = [[0, 1], [2, 3]]
    expect = {name: next(g for g in dim_groups(grid, d) if rank in g) for d, name in enumerate(("dp", "tp"))}
    got = {name: tdist.get_process_group_ranks(mesh.get_group(name)) for name in ("dp", "tp")}
    t = torch.full((2,), float(rank))
    tdist.all_reduce(t, group=mesh.get_group("tp"))
    full = torch.arange(16.0).reshape(4, 4)
    d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    return {"groups_match": got == expect, "backends": {n: tdist.get_backend(mesh.get_group(n)) for n in ("dp", "tp")},
            "tp_sum": t.tolist() == [float(sum(expect["tp"]))] * 2,
            "dtensor_2d": torch.equal(d.redistribute(mesh, [Replicate(), Replicate()]).to_local(), full),
            "coordinate": list(mesh.get_coordinate()), "local_ranks": [mesh.get_local_rank(n) for n in ("dp", "tp")]}
