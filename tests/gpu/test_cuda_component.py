"""chorus.cuda on real GPUs, one process per GPU, differential against torch's NCCL
(tests/gpu/gpu_workers.py).  Run by tests/gpu/run_gpu_tests.sh on the GPU machine."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip(f"needs 2+ CUDA GPUs (this machine has {torch.cuda.device_count()})", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install 'chorus[cuda]')")
pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed (pip install 'chorus[cuda]')")

import gpu_workers  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from ports import free_port  # noqa: E402


def ports() -> tuple[int, int]:
    first = free_port(pair=True)  # (NCCL's store, then chorus's)
    return first, first + 1


WORLDS = [w for w in (2, 3, 4) if w <= torch.cuda.device_count()]


@pytest.fixture
def small_workspace(monkeypatch):
    """4 MiB workspaces: 1 MiB slots and channels of a few hundred KiB, so the tests'
    messages take many rounds and chunks."""
    monkeypatch.setenv("CHORUS_CUDA_WORKSPACE_BYTES", str(4 << 20))
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")


@pytest.mark.parametrize("world", WORLDS)
def test_every_collective_and_p2p(world, small_workspace):
    mp.spawn(gpu_workers.run, args=(world, ports(), ["all_reduce", "rooted", "p2p", "async"]), nprocs=world)


def test_cuda_graphs(small_workspace):
    mp.spawn(gpu_workers.run, args=(min(4, torch.cuda.device_count()), ports(), ["graph"]), nprocs=min(
        4, torch.cuda.device_count()))


def test_nccl_gather_hand_off(small_workspace):
    world = min(4, torch.cuda.device_count())
    mp.spawn(gpu_workers.run, args=(world, ports(), ["nccl_gather"]), nprocs=world)


def test_staging_fallback(small_workspace, monkeypatch):
    monkeypatch.setenv("CHORUS_CUDA_STAGING", "1")
    mp.spawn(gpu_workers.run, args=(2, ports(), ["rooted", "p2p"]), nprocs=2)


def test_the_workspace_check_reads_through_triton_when_its_ptx_does_not_load(small_workspace):
    world = min(4, torch.cuda.device_count())
    mp.spawn(gpu_workers.run_ptx_unavailable, args=(world, ports()), nprocs=world)


def test_a_rank_whose_check_copies_fail_sends_every_rank_to_staging(small_workspace):
    mp.spawn(gpu_workers.run_write_fails, args=(min(3, torch.cuda.device_count()), ports()), nprocs=min(
        3, torch.cuda.device_count()))


def test_all_gather_and_reduce_scatter_through_the_lane(small_workspace):
    mp.spawn(gpu_workers.run, args=(2, ports(), ["rows"]), nprocs=2)


def test_repeated_all_reduces_replay_cuda_graphs(small_workspace):
    mp.spawn(gpu_workers.run, args=(2, ports(), ["replay"]), nprocs=2)


def test_repeated_all_gathers_and_reduce_scatters_replay_cuda_graphs(small_workspace):
    world = min(4, torch.cuda.device_count())
    mp.spawn(gpu_workers.run, args=(world, ports(), ["rows_replay"]), nprocs=world)


@pytest.mark.parametrize("name", ["all_reduce", "all_gather"])
def test_a_replayed_kernel_s_timeout_names_its_own_op(small_workspace, name):
    mp.spawn(gpu_workers.run_replay_timeout, args=(2, ports(), name), nprocs=2)


def test_spin_timeout_is_reported(small_workspace):
    mp.spawn(gpu_workers.run_timeout, args=(2, ports()), nprocs=2)


@pytest.mark.parametrize("ahead", [False, True], ids=["host-poll-word-as-is", "host-poll-word-ahead-of-clock"])
def test_abort_reaches_a_spinning_fused_kernel(small_workspace, ahead):
    mp.spawn(gpu_workers.run_abort, args=(2, ports(), ahead), nprocs=2)


def test_ranks_as_threads_stage_through_host_memory(small_workspace, monkeypatch):
    """Ranks that are threads of one process get no workspace (chorus.cuda.workspace says
    why, and each thread frees the one it allocated): the group stages every op, a large
    all_reduce too, every result right, and nothing waits for a spin that cannot end."""
    from chorus.api.state import current
    from chorus.cuda import workspace
    from chorus.cuda.component import attach
    from chorus.store import HashStore
    from chorus.testing import run_threads

    store = HashStore()
    world = min(4, torch.cuda.device_count())
    n, big = 300_001, 4_200_001  # big: where a group with a workspace would hand off to NCCL
    closed = []
    close = workspace.Workspace.close
    monkeypatch.setattr(workspace.Workspace, "close", lambda ws: (closed.append(ws.rank), close(ws)))

    def body(rank, world):
        torch.cuda.set_device(rank)
        current().store = store
        pg = current().default_group
        comp = attach(pg)
        assert comp.lanes is None and "threads of one process" in comp.staging_reason, comp.staging_reason
        assert not comp._handoff  # (staged: no call goes to NCCL)
        issue = gpu_workers.issue
        x = torch.full((n,), float(rank + 1), device="cuda")
        issue(comp, pg, "all_reduce", {"data": x}, count=n, dtype="float32", reduce_op="SUM")
        y = torch.full((big,), float(rank + 1), device="cuda")
        issue(comp, pg, "all_reduce", {"data": y}, count=big, dtype="float32", reduce_op="SUM")
        inp = torch.arange(n, device="cuda", dtype=torch.float32) + rank * n
        out = torch.empty(world * n, device="cuda")
        issue(comp, pg, "all_gather", {"input": inp, "output": out}, count=n, dtype="float32")
        b = torch.full((n,), float(rank), device="cuda")
        issue(comp, pg, "broadcast", {"data": b}, count=n, dtype="float32", root=world - 1)
        sent = torch.arange(2_000_001, device="cuda", dtype=torch.float32) * (rank + 1)
        got = torch.empty_like(sent)
        comp.p2p_batch([("send", sent, (rank + 1) % world, 5), ("recv", got, (rank - 1) % world, 5)], False)
        torch.cuda.synchronize()
        comp.check("threads")
        result = [t.cpu() for t in (x, y, out, b, got)]
        comp.close()
        return result

    results = run_threads(body, world, timeout=120)
    assert sorted(closed) == list(range(world))  # every thread's refused workspace freed
    want_sum = float(sum(range(1, world + 1)))
    want_gather = torch.arange(world * n, dtype=torch.float32)
    for rank, (x, y, out, b, got) in enumerate(results):
        assert bool((x == want_sum).all()) and bool((y == want_sum).all()), rank
        assert torch.equal(out, want_gather), rank
        assert bool((b == world - 1).all()), rank
        left = (rank - 1) % world
        assert torch.equal(got, torch.arange(2_000_001, dtype=torch.float32) * (left + 1)), rank
