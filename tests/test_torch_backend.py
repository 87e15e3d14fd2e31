"""chorus as a torch.distributed backend (chorus.torch), in real processes.

One job per world size runs every check inside (starting torch in a process costs
seconds on a small machine): every backend method through torch.distributed's API
and the functional collectives, sub-groups, a gloo group in the same job, DDP (chorus vs
gloo, step by step), FSDP2 vs a single-process run, DTensor, DeviceMesh, distributed
checkpoints across backends, and the failure paths (collective mismatch, killed rank).
What the ranks run for the training checks is in tests/torch_training.py.
"""

from __future__ import annotations

import math
import tempfile
import time
import traceback
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch", reason="chorus.torch needs torch (pip install 'chorus[torch]')")

import torch.distributed as tdist  # noqa: E402
from proc_support import run_forked  # noqa: E402
from torch_training import (  # noqa: E402
    MLP,
    checkpoint,
    ddp_variant,
    ddp_vs_gloo,
    device_mesh,
    dtensor,
    fsdp2,
    shared_buckets,
)

import chorus.torch  # noqa: E402, F401 - registers the backend

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

F32 = torch.float32
DDP_STEPS = 6  # DDP rebuilds its buckets after the first step: later steps run on the rebuilt ones


# -- job plumbing ----------------------------------------------------------------------------
def _job_main(rank, world, workdir, body):
    results, failures, seconds = {}, {}, {}
    tdist.init_process_group("chorus", init_method=f"file://{workdir}/rdv", rank=rank, world_size=world)
    for name, check in body(rank, world, workdir):
        start = time.perf_counter()
        try:
            results[name] = check()
        except Exception:  # noqa: BLE001 - reported by the test with the traceback
            failures[name] = traceback.format_exc()
        seconds[name] = round(time.perf_counter() - start, 2)
    results["seconds"] = seconds
    if tdist.is_initialized():
        tdist.destroy_process_group()
    return results, failures


def _run_job(body, world):
    with tempfile.TemporaryDirectory(prefix="chorus-torch-") as workdir:
        out = run_forked(_job_main, world, workdir, body, timeout=110)
    failures = {(rank, name): tb for rank, (_, fails) in enumerate(out) for name, tb in fails.items()}
    assert not failures, "\n".join(f"rank {r} {name}:\n{tb}" for (r, name), tb in failures.items())
    return [results for results, _ in out]


@pytest.fixture(scope="module")
def job2():
    return _run_job(_checks, 2)


@pytest.fixture(scope="module")
def job4():
    return _run_job(_checks, 4)


def _checks(rank, world, workdir):
    """(name, check) pairs; every rank runs them in this order."""
    sub = tdist.new_group(list(range(1, world)) if world > 2 else [0, 1], backend="chorus")
    gloo = tdist.new_group(backend="gloo")
    checks = [
        ("identity", lambda: _identity(sub)),
        ("methods_world", lambda: _methods(rank, world, None)),
        ("methods_sub", lambda: _methods(rank, world, sub) if rank in tdist.get_process_group_ranks(sub) else {}),
        ("coalesced", lambda: _coalesced(rank, world)),
        ("p2p", lambda: _p2p(rank, world)),
        ("functional", lambda: _functional(rank, world)),
        ("objects", lambda: _objects(rank, world)),
        ("errors", lambda: _errors()),
        ("ddp_vs_gloo", lambda: ddp_vs_gloo(rank, world, gloo, steps=DDP_STEPS if world == 4 else 3)),
        ("fsdp2", lambda: fsdp2(rank, world)),
        ("dtensor", lambda: dtensor(world)),
        ("checkpoint", lambda: checkpoint(rank, world, gloo, workdir)),
        ("shared_buckets", lambda: shared_buckets(rank, world, gloo)),
    ]
    if world == 2:
        checks += [(f"ddp_{variant}", lambda v=variant: ddp_variant(rank, world, gloo, v))
                   for variant in ("bucket_view", "unused", "no_sync", "fp16_hook")]
        checks.append(("mismatch", lambda: _mismatch(rank)))
        checks.append(("profiler", lambda: _profiler_events(rank)))
        checks.append(("sparse", lambda: _sparse(rank)))
        checks.append(("gloo_default", lambda: _gloo_default_job(rank, world, workdir)))
    if world == 4:
        checks.append(("device_mesh", lambda: device_mesh(rank)))
    return checks


# -- every backend method ------------------------------------------------------------------
def _identity(sub):
    world = tdist.group.WORLD
    member = sub is not tdist.GroupMember.NON_GROUP_MEMBER
    return {"backend": tdist.get_backend(), "sub_backend": tdist.get_backend(sub) if member else "chorus", "name": world.name(),
            "cls": type(world).__name__, "rank": world.rank(), "size": world.size(),
            "group_name": world.group_name}


def _methods(rank, world, group):
    """Each torch.distributed call on ``group``; returns name -> bool (matches expectation)."""
    ranks = tdist.get_process_group_ranks(group) if group is not None else list(range(world))
    me, n = ranks.index(rank), len(ranks)

    def x(r, k=3, dtype=F32):
        return (torch.arange(k, dtype=F32) + 10 * r).to(dtype)

    ok = {}
    for dtype in (F32, torch.int64, torch.bfloat16, torch.float16):
        t = x(me, dtype=dtype)
        tdist.all_reduce(t, group=group)
        ok[f"all_reduce_{dtype}"] = torch.equal(t, sum(x(r) for r in range(n)).to(dtype))
    # tensors the backend cannot hand chorus as a numpy view: 0-d, strided, requiring grad
    scalar = torch.tensor(float(me + 1))
    tdist.all_reduce(scalar, group=group)
    ok["all_reduce_0d"] = scalar.item() == n * (n + 1) / 2
    grid = torch.stack([x(me), x(me)], dim=1)
    tdist.all_reduce(grid[:, 0], group=group)  # a column: a strided view, written back in place
    ok["all_reduce_strided"] = torch.equal(grid[:, 0], sum(x(r) for r in range(n))) and torch.equal(grid[:, 1], x(me))
    leaf = x(me).requires_grad_()
    tdist.all_reduce(leaf, group=group, async_op=True).wait()
    ok["all_reduce_requires_grad"] = torch.equal(leaf.detach(), sum(x(r) for r in range(n)))
    for op, expect in ((tdist.ReduceOp.MAX, x(n - 1)), (tdist.ReduceOp.MIN, x(0)),
                       (tdist.ReduceOp.AVG, sum(x(r) for r in range(n)) / n),
                       (tdist._make_nccl_premul_sum(2.0), 2 * sum(x(r) for r in range(n)))):
        t = x(me)
        tdist.all_reduce(t, op=op, group=group)
        ok[f"all_reduce_{op}"] = torch.allclose(t, expect)
    t = x(me)
    work = tdist.all_reduce(t, group=group, async_op=True)
    fut_value = work.get_future().wait()
    ok["all_reduce_async"] = work.is_completed() and work.is_success() and torch.equal(fut_value[0], sum(x(r) for r in range(n)))
    out = [torch.empty(3) for _ in range(n)]
    tdist.all_gather(out, x(me), group=group)
    ok["all_gather"] = all(torch.equal(out[r], x(r)) for r in range(n))
    expect_cat = torch.cat([x(r) for r in range(n)])
    for name in ("all_gather_into_tensor", "all_gather_single"):
        o = torch.empty(3 * n)
        getattr(tdist, name)(o, x(me), group=group)
        ok[name] = torch.equal(o, expect_cat)
    o = torch.empty(3 * n)
    tdist.all_gather_into_tensor(o, x(me), group=group, async_op=True).wait()
    ok["all_gather_into_tensor_async"] = torch.equal(o, expect_cat)
    o = torch.empty(2)
    tdist.reduce_scatter(o, [x(me, 2) + r for r in range(n)], group=group)
    ok["reduce_scatter"] = torch.equal(o, sum(x(r, 2) for r in range(n)) + n * me)
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        o = torch.empty(2)
        getattr(tdist, name)(o, torch.cat([x(me, 2) + r for r in range(n)]), group=group)
        ok[name] = torch.equal(o, sum(x(r, 2) for r in range(n)) + n * me)
    outs = [torch.empty(2) for _ in range(n)]
    tdist.all_to_all(outs, [x(me, 2) + 100 * r for r in range(n)], group=group)
    ok["all_to_all"] = all(torch.equal(outs[r], x(r, 2) + 100 * me) for r in range(n))
    o = torch.empty(2 * n)
    tdist.all_to_all_single(o, torch.cat([x(me, 2) + 100 * r for r in range(n)]), group=group)
    ok["all_to_all_single"] = torch.equal(o, torch.cat([x(r, 2) + 100 * me for r in range(n)]))
    # uneven: rank r sends (j + 1) rows to rank j
    send = [torch.full((j + 1,), float(me * 10 + j)) for j in range(n)]
    o = torch.empty(n * (me + 1))
    tdist.all_to_all_single(o, torch.cat(send), output_split_sizes=[me + 1] * n,
                            input_split_sizes=[j + 1 for j in range(n)], group=group)
    ok["all_to_all_single_uneven"] = torch.equal(o, torch.cat([torch.full((me + 1,), float(r * 10 + me)) for r in range(n)]))
    root = ranks[-1]
    t = x(me)
    tdist.broadcast(t, src=root, group=group)
    ok["broadcast"] = torch.equal(t, x(n - 1))
    t = x(me)
    tdist.reduce(t, dst=root, group=group)
    ok["reduce"] = torch.equal(t, sum(x(r) for r in range(n))) if me == n - 1 else torch.equal(t, x(me))
    gl = [torch.empty(3) for _ in range(n)] if me == 0 else None
    tdist.gather(x(me), gl, dst=ranks[0], group=group)
    ok["gather"] = all(torch.equal(gl[r], x(r)) for r in range(n)) if me == 0 else True
    t = torch.empty(3)
    tdist.scatter(t, [x(r) * 2 for r in range(n)] if me == n - 1 else None, src=root, group=group)
    ok["scatter"] = torch.equal(t, x(me) * 2)
    tdist.barrier(group=group)
    tdist.barrier(group=group, async_op=True).wait()
    ok["barrier"] = True
    return ok


def _coalesced(rank, world):
    """The coalesced entry points: the deprecated *_coalesced APIs and _coalescing_manager."""
    from torch._C._distributed_c10d import AllreduceCoalescedOptions
    from torch.distributed.distributed_c10d import _coalescing_manager

    ok = {}
    total = sum(range(world))
    ts = [torch.full((2,), float(rank)), torch.full((1,), 1.0 + rank)]
    tdist.all_reduce_coalesced(ts)
    ok["all_reduce_coalesced"] = (torch.equal(ts[0], torch.full((2,), float(total)))
                                  and torch.equal(ts[1], torch.full((1,), float(total + world))))
    mixed = [torch.full((2,), float(rank)), torch.full((3,), rank, dtype=torch.int32), torch.full((1,), 1.0 + rank)]
    opts = AllreduceCoalescedOptions()
    opts.reduceOp = tdist.ReduceOp.SUM
    tdist.group.WORLD.allreduce_coalesced(mixed, opts).wait()  # torch's API refuses mixed dtypes
    ok["allreduce_coalesced_mixed_dtypes"] = (torch.equal(mixed[0], torch.full((2,), float(total)))
                                              and torch.equal(mixed[1], torch.full((3,), total, dtype=torch.int32))
                                              and torch.equal(mixed[2], torch.full((1,), float(total + world))))
    outs = [[torch.empty(2), torch.empty(1)] for _ in range(world)]
    tdist.all_gather_coalesced(outs, [torch.full((2,), float(rank)), torch.full((1,), -float(rank))])
    ok["all_gather_coalesced"] = all(torch.equal(outs[r][0], torch.full((2,), float(r)))
                                     and torch.equal(outs[r][1], torch.full((1,), -float(r))) for r in range(world))
    with _coalescing_manager(async_ops=True) as cm:
        a, b = torch.full((2,), 1.0 + rank), torch.full((4,), 2.0)
        tdist.all_reduce(a)
        tdist.all_reduce(b)
    cm.wait()
    ok["manager_all_reduce"] = torch.equal(a, torch.full((2,), float(world + total))) and torch.equal(b, torch.full((4,), 2.0 * world))
    o1, o2 = torch.empty(2 * world), torch.empty(world)
    with _coalescing_manager(async_ops=True) as cm:
        tdist.all_gather_into_tensor(o1, torch.full((2,), float(rank)))
        tdist.all_gather_into_tensor(o2, torch.full((1,), float(rank)))
    cm.wait()
    ok["manager_all_gather"] = torch.equal(o1, torch.arange(world, dtype=F32).repeat_interleave(2)) and torch.equal(o2, torch.arange(world, dtype=F32))
    r1 = torch.empty(2)
    with _coalescing_manager(async_ops=True) as cm:
        tdist.reduce_scatter_tensor(r1, torch.arange(2.0 * world))
    cm.wait()
    ok["manager_reduce_scatter"] = torch.equal(r1, torch.arange(2.0 * rank, 2.0 * rank + 2) * world)
    return ok


def _p2p(rank, world):
    ok = {}
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(3)
    if rank % 2 == 0:
        tdist.send(torch.full((3,), float(rank)), dst=nxt, tag=7)
        tdist.recv(got, src=prv, tag=7)
    else:
        tdist.recv(got, src=prv, tag=7)
        tdist.send(torch.full((3,), float(rank)), dst=nxt, tag=7)
    ok["send_recv"] = torch.equal(got, torch.full((3,), float(prv)))
    got = torch.empty(2)
    reqs = tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, torch.full((2,), float(rank)), nxt),
                                    tdist.P2POp(tdist.irecv, got, prv)])
    for r in reqs:
        r.wait()
    ok["batch_isend_irecv"] = torch.equal(got, torch.full((2,), float(prv)))
    if rank == 0:
        senders = set()
        for _ in range(world - 1):
            buf = torch.empty(1)
            src = tdist.recv(buf)  # any source
            senders.add((src, int(buf.item())))
        ok["recv_anysource"] = senders == {(r, r) for r in range(1, world)}
        w = tdist.irecv(torch.empty(1), src=None, tag=5)
        w.wait()
        ok["irecv_anysource_source_rank"] = w._source_rank() in range(1, world)
    else:
        tdist.send(torch.full((1,), float(rank)), dst=0)
        if rank == 1:
            tdist.isend(torch.zeros(1), dst=0, tag=5).wait()
    tdist.barrier()
    return ok


def _functional(rank, world):
    """torch's functional collectives (used by DTensor, FSDP2) reach chorus from C++."""
    import torch.distributed._functional_collectives as fc

    group, ok = tdist.group.WORLD, {}
    x = torch.arange(4, dtype=F32) + rank
    ok["all_reduce"] = torch.equal(fc.all_reduce(x, "sum", group).wait(), sum(torch.arange(4, dtype=F32) + r for r in range(world)))
    ok["all_gather_tensor"] = torch.equal(fc.all_gather_tensor(x, 0, group).wait(), torch.cat([torch.arange(4, dtype=F32) + r for r in range(world)]))
    big = torch.arange(2.0 * world)
    ok["reduce_scatter_tensor"] = torch.equal(fc.reduce_scatter_tensor(big, "sum", 0, group).wait(), torch.arange(2.0 * rank, 2.0 * rank + 2) * world)
    a2a = torch.arange(float(world)) + 10 * rank
    ok["all_to_all_single"] = torch.equal(fc.all_to_all_single(a2a, None, None, group).wait(), torch.arange(float(world)) * 10 + rank)
    ok["broadcast"] = torch.equal(fc.broadcast(x.clone(), 0, group).wait(), torch.arange(4, dtype=F32))
    outs = fc.all_reduce_coalesced([x, x * 2], "sum", group)
    total = sum(torch.arange(4, dtype=F32) + r for r in range(world))
    ok["all_reduce_coalesced"] = torch.equal(outs[0].wait(), total) and torch.equal(outs[1].wait(), 2 * total)
    return ok


def _objects(rank, world):
    objs = [None] * world
    tdist.all_gather_object(objs, {"rank": rank})
    lst = [f"from {rank}"]
    tdist.broadcast_object_list(lst, src=world - 1)
    return objs == [{"rank": r} for r in range(world)] and lst == [f"from {world - 1}"]


def _errors():
    """CUDA-like tensors get an error naming the alternative; torch routes monitored_barrier only to gloo."""
    out = {}
    try:
        tdist.all_reduce(torch.empty(2, device="meta"))
    except Exception as exc:  # noqa: BLE001
        out["device"] = f"{type(exc).__name__}: {exc}"
    try:
        tdist.monitored_barrier(timeout=timedelta(seconds=30))
    except Exception as exc:  # noqa: BLE001
        out["monitored_barrier"] = f"{type(exc).__name__}: {exc}"
    tdist.group.WORLD.monitored_barrier(timedelta(seconds=30))  # the method itself
    return out


# -- failure paths ---------------------------------------------------------------------------
def _mismatch(rank):
    """Rank 1 sneaks an extra all_reduce between forward and backward of a DDP step: rank 0's
    gradient all-reduce meets it; both ranks fail fast, naming both calls."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = tdist.new_group(backend="chorus")
    torch.manual_seed(0)
    model = DDP(MLP(), process_group=group)
    x = torch.randn(8, 16)
    for _ in range(2):
        model(x).sum().backward()
    start = time.monotonic()
    try:
        out = model(x).sum()
        if rank == 1:
            tdist.all_reduce(torch.zeros(3), group=group)
        out.backward()
        return {"error": None}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__,
                "seconds": time.monotonic() - start, "torch_class": isinstance(exc, tdist.DistBackendError)}


def _profiler_events(rank):
    """The events torch's profiler shows for chorus's ops: name, async, whether it ended
    before a marker recorded 50 ms after the ops (an event whose end torch missed lasts
    until the profile stops), input shapes."""
    t = torch.ones(4, 5)
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        tdist.all_reduce(t)
        tdist.all_reduce(torch.ones(3, dtype=torch.complex64), async_op=True).wait()
        if rank == 0:
            tdist.send(torch.ones(2), dst=1)
        else:
            tdist.recv(torch.empty(2), src=0)
        time.sleep(0.05)
        with torch.autograd.profiler.record_function("marker"):
            pass
    [marker] = [e.time_range.start for e in prof.function_events if e.name == "marker"]
    return sorted((e.name, e.is_async, e.time_range.end < marker, e.input_shapes) for e in prof.function_events
                  if e.name.startswith("chorus:"))


def _sparse(rank):
    """all_reduce of a sparse COO tensor (SUM, as gloo); other ops and collectives refuse one."""
    t = torch.sparse_coo_tensor([[rank, 2]], [1.0 + rank, 10.0], (4,))
    tdist.all_reduce(t)
    out = {"sum": t.to_dense().tolist()}
    for name, call in (("max", lambda: tdist.all_reduce(t, op=tdist.ReduceOp.MAX)),
                       ("broadcast", lambda: tdist.broadcast(t, src=0))):
        try:
            call()
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def _gloo_default_job(rank, world, workdir):
    """Re-initialize with gloo as the default group and a chorus sub-group of its own."""
    tdist.destroy_process_group()
    tdist.init_process_group("gloo", init_method=f"file://{workdir}/rdv-gloo", rank=rank, world_size=world)
    group = tdist.new_group(backend="chorus")
    t = torch.full((3,), float(rank + 1))
    tdist.all_reduce(t, group=group)
    u = torch.full((3,), float(rank + 1))
    tdist.all_reduce(u)
    return {"chorus": t.tolist(), "gloo": u.tolist(), "backends": (tdist.get_backend(), tdist.get_backend(group))}


# -- the tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_every_method_matches_expectations(world, request):
    results = request.getfixturevalue(f"job{world}")
    for rank, r in enumerate(results):
        assert r["identity"] == {"backend": "chorus", "sub_backend": "chorus", "name": "chorus",
                                 "cls": "ChorusProcessGroup", "rank": rank, "size": world,
                                 "group_name": r["identity"]["group_name"]}
        for section in ("methods_world", "methods_sub", "coalesced", "p2p", "functional"):
            bad = [name for name, good in r[section].items() if not good]
            assert not bad, f"rank {rank} {section}: wrong results from {bad}"
        assert r["objects"]
        assert "moves CPU and CUDA tensors" in r["errors"]["device"] and "meta" in r["errors"]["device"]
        assert "only implemented for GLOO" in r["errors"]["monitored_barrier"]
    assert len(results[0]["methods_world"]) >= 24 and len(results[0]["coalesced"]) == 6


def test_ddp_w4_matches_gloo_step_by_step(job4):
    for r in job4:
        ddp = r["ddp_vs_gloo"]
        assert len(ddp["losses"]) == DDP_STEPS
        for mine, theirs in zip(ddp["losses"], ddp["gloo_losses"], strict=True):
            assert math.isclose(mine, theirs, rel_tol=1e-6), (ddp["losses"], ddp["gloo_losses"])
        assert ddp["identical_across_ranks"]
        assert ddp["params_equal_gloo"] < 1e-6


@pytest.mark.parametrize("world", [2, 4])
def test_reused_tensors_move_into_shared_memory_and_take_the_mapped_path(world, request):
    for r in request.getfixturevalue(f"job{world}"):
        s = r["shared_buckets"]
        assert s["right"] == [True] * 3 and s["shared"] and s["fresh_shared"] == [False] * 3
        assert s["a2a_ok"] == [True] * 3 and s["a2a_shared"] and s["numpy_alias"]
        assert s["mapped_ops"] == 2  # the first all_reduce only counts the storage; the others map it
        assert s["ddp_mapped_ops"] >= 2  # DDP's bucket of the 2 MiB weight and its bias (more than a slot), from its second all_reduce on
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(s["losses"], s["gloo_losses"], strict=True)), s
        assert s["max_param_diff"] < 1e-6


def test_ddp_variants_match_gloo(job2):
    for r in job2:
        assert r["ddp_vs_gloo"]["identical_across_ranks"]
        for variant in ("bucket_view", "unused", "no_sync"):
            v = r[f"ddp_{variant}"]
            assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(v["losses"], v["gloo_losses"], strict=True)), (variant, v)
            assert v["max_param_diff"] < 1e-6, variant
        fp16 = r["ddp_fp16_hook"]
        assert all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(fp16["losses"], fp16["gloo_losses"], strict=True)), fp16
        assert fp16["max_param_diff"] < 1e-3


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_dtensor_checkpoint(world, request):
    for r in request.getfixturevalue(f"job{world}"):
        fsdp = r["fsdp2"]
        for mine, ref in zip(fsdp["losses"], fsdp["ref_losses"], strict=True):
            assert math.isclose(mine, ref, rel_tol=1e-5, abs_tol=1e-6), fsdp
        assert fsdp["max_param_diff"] < 1e-5
        assert r["dtensor"] == {"replicate_exact": True, "shard1_exact": True, "round_trip_exact": True,
                                "mesh_backend": "chorus"}
        assert r["checkpoint"] == {"chorus_to_gloo": True, "chorus_to_gloo_sharded": "DTensor",
                                   "gloo_to_chorus": True, "gloo_to_chorus_sharded": "DTensor"}


def test_device_mesh_2x2_on_chorus(job4):
    for rank, r in enumerate(job4):
        mesh = r["device_mesh"]
        assert mesh["groups_match"] and mesh["tp_sum"] and mesh["dtensor_2d"]
        assert mesh["backends"] == {"dp": "chorus", "tp": "chorus"}
        assert mesh["coordinate"] == [rank // 2, rank % 2] and mesh["local_ranks"] == [rank // 2, rank % 2]


def test_gloo_default_with_chorus_subgroup(job2):
    for r in job2:
        assert r["gloo_default"] == {"chorus": [3.0] * 3, "gloo": [3.0] * 3, "backends": ("gloo", "chorus")}


def test_collective_mismatch_in_ddp_fails_every_rank_fast(job2):
    for r in job2:
        m = r["mismatch"]
        assert m["error"] is not None and "CollectiveMismatchError" in m["error"], m
        assert "all_reduce(float32, count=3, op=SUM)" in m["error"], m  # names the odd call
        assert m["seconds"] < 5, m
    assert job2[1]["mismatch"]["type"] == "CollectiveMismatchError"  # chorus's own, from all_reduce
    assert job2[1]["mismatch"]["torch_class"]  # and torch's DistBackendError


def test_ops_are_async_events_of_torch_profiler_that_end_with_the_op(job2):
    for rank, r in enumerate(job2):
        p2p = ("chorus:send", True, True, [[2]]) if rank == 0 else ("chorus:recv", True, True, [[2]])
        assert r["profiler"] == sorted([("chorus:all_reduce", True, True, [[4, 5]]),
                                        ("chorus:all_reduce", True, True, [[3, 2]]), p2p])


def test_sparse_all_reduce_sums_and_other_uses_are_refused(job2):
    for r in job2:
        assert r["sparse"]["sum"] == [1.0, 2.0, 20.0, 0.0]
        assert "sparse tensors are reduced with ReduceOp.SUM only" in r["sparse"]["max"]
        assert "sparse_coo tensor" in r["sparse"]["broadcast"] and ".to_dense()" in r["sparse"]["broadcast"]
    # rank 0 is inside DDP's backward: torch's C++ reducer wraps it in a RuntimeError
    assert isinstance(job2[0]["mismatch"]["type"], str)
