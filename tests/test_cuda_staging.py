"""chorus.cuda's staging fallback (chorus.cuda.staging) with CPU tensors standing in for
CUDA ones (nothing is pinned then; the path is the same): every collective through
chorus's CPU components, ranks as threads, against torch references."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cuda_emulation import reference  # noqa: E402

from chorus.api.state import current  # noqa: E402
from chorus.call import make  # noqa: E402
from chorus.components import select  # noqa: E402
from chorus.cuda import staging  # noqa: E402
from chorus.testing import run_threads  # noqa: E402

W = 3
N = 37


def data(rank: int, n: int, dtype, salt: int = 0) -> torch.Tensor:
    values = (torch.arange(n) * 5 + rank * 3 + salt) % 4
    return values > 1 if dtype == torch.bool else values.to(dtype)


def run(name, buffers, *, dtype="float32", count=N, reduce_op="", root=-1, args=None, after=None, uniform=True,
        async_op=False, algorithm=None):
    pg = current().default_group
    call = make(pg, name, dtype=dtype, count=count, buffers=buffers, async_op=async_op, algorithm=algorithm,
                nbytes=count * 4, args=args or {"count": count}, root=root, reduce_op=reduce_op, after=after,
                uniform=uniform)
    work = staging.start(call, "staging", select.start)
    if work is not None:
        work.wait()


def collectives(rank, world):
    out = {}
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.bool, "bool"),
                        (torch.int64, "int64")):
        for op in ("SUM", "MAX", "PRODUCT"):
            t = data(rank, N, dtype)
            run("all_reduce", {"data": t}, dtype=name, reduce_op=op, async_op=op == "MAX")
            out["all_reduce", name, op] = t
    if hasattr(torch, "float8_e4m3fn"):
        t = data(rank, N, torch.float8_e4m3fn)
        run("all_reduce", {"data": t}, dtype="uint8", reduce_op="SUM")
        out["all_reduce", "float8", "SUM"] = t
    t = data(rank, N, torch.float32)
    run("reduce", {"data": t}, reduce_op="SUM", root=1)
    out["reduce"] = t
    t = data(rank, N, torch.float32)
    run("broadcast", {"data": t}, root=2)
    out["broadcast"] = t
    o = torch.empty(world * N)
    run("all_gather", {"input": data(rank, N, torch.float32), "output": o})
    out["all_gather"] = o
    o = torch.empty(world * N)
    run("gather", {"input": data(rank, N, torch.float32), **({"output": o} if rank == 0 else {})}, root=0)
    out["gather"] = o if rank == 0 else None
    o = torch.empty(N)
    run("scatter", {"output": o, **({"input": data(rank, world * N, torch.float32, 7)} if rank == 1 else {})},
        root=1)
    out["scatter"] = o
    counts = (5, 0, 11)
    o = torch.empty(counts[rank])
    run("reduce_scatter", {"input": data(rank, sum(counts), torch.float32), "output": o}, reduce_op="SUM",
        count=sum(counts), args={"counts": counts}, uniform=False, algorithm="fused")  # (chorus.cuda's names:
    out["reduce_scatter"] = o                                                          # the CPU path chooses)
    send = [rank + j + 1 for j in range(world)]
    recv = [i + rank + 1 for i in range(world)]
    o = torch.empty(sum(recv))
    run("all_to_all", {"input": data(rank, sum(send), torch.float32) + 10 * rank, "output": o}, count=0,
        args={"send_counts": tuple(send), "recv_counts": tuple(recv)}, uniform=False, algorithm="channels")
    out["all_to_all"] = o
    pg = current().default_group
    if rank == 0:
        staging.p2p(pg, "send", data(0, N, torch.bfloat16, 1), 1, 5, False)
    elif rank == 1:
        got = torch.empty(N, dtype=torch.bfloat16)
        staging.p2p(pg, "recv", got, 0, 5, True).wait()
        out["p2p"] = got
    return out


def test_staged_collectives_match_torch():
    res = run_threads(collectives, W)
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.bool, "bool"),
                        (torch.int64, "int64")):
        for op in ("SUM", "MAX", "PRODUCT"):
            want = reference([data(r, N, dtype) for r in range(W)], op)
            for r in range(W):
                assert torch.equal(res[r]["all_reduce", name, op], want), (name, op, r)
    if hasattr(torch, "float8_e4m3fn"):
        want = reference([data(r, N, torch.float8_e4m3fn) for r in range(W)], "SUM")
        assert all(torch.equal(res[r]["all_reduce", "float8", "SUM"].view(torch.uint8), want.view(torch.uint8))
                   for r in range(W))
    ins = [data(r, N, torch.float32) for r in range(W)]
    assert torch.equal(res[1]["reduce"], sum(ins)) and torch.equal(res[0]["reduce"], ins[0])
    assert all(torch.equal(res[r]["broadcast"], ins[2]) for r in range(W))
    assert all(torch.equal(res[r]["all_gather"], torch.cat(ins)) for r in range(W))
    assert torch.equal(res[0]["gather"], torch.cat(ins))
    assert all(torch.equal(res[r]["scatter"], data(1, W * N, torch.float32, 7)[r * N:(r + 1) * N]) for r in range(W))
    total = sum(data(r, 16, torch.float32) for r in range(W))
    assert torch.equal(res[0]["reduce_scatter"], total[:5]) and torch.equal(res[2]["reduce_scatter"], total[5:])
    for j in range(W):
        parts = []
        for i in range(W):
            send = [i + k + 1 for k in range(W)]
            block = data(i, sum(send), torch.float32) + 10 * i
            parts.append(block[sum(send[:j]):sum(send[:j + 1])])
        assert torch.equal(res[j]["all_to_all"], torch.cat(parts))
    assert torch.equal(res[1]["p2p"], data(0, N, torch.bfloat16, 1))


def test_members_on_two_hosts_never_map_and_stage_through_the_hierarchy(monkeypatch):
    """``CHORUS_HOST_ID=a,a,b,b``: the CUDA workspace sees two hosts (so attach stages,
    chorus.cuda.workspace) and the staged calls run on the group's hierarchical path."""
    from chorus.cuda.workspace import _host_id

    monkeypatch.setenv("CHORUS_HOST_ID", "a,a,b,b")
    assert [_host_id(r) for r in range(4)] == ["CHORUS_HOST_ID=a"] * 2 + ["CHORUS_HOST_ID=b"] * 2

    def body(rank, world):
        pg = current().default_group
        assert pg.hierarchy is not None and pg.shm is None
        t = data(rank, N, torch.float32)
        run("all_reduce", {"data": t}, reduce_op="SUM")
        o = torch.empty(world * N)
        run("all_gather", {"input": data(rank, N, torch.float32), "output": o})
        b = data(rank, N, torch.bfloat16)
        run("broadcast", {"data": b}, dtype="bfloat16", root=3)
        return t, o, b

    res = run_threads(body, 4)
    ins = [data(r, N, torch.float32) for r in range(4)]
    for t, o, b in res:
        assert torch.equal(t, sum(ins)) and torch.equal(o, torch.cat(ins))
        assert torch.equal(b, data(3, N, torch.bfloat16))



def test_members_that_are_threads_of_one_process_get_no_workspace(monkeypatch):
    """chorus.cuda.workspace refuses peer memory to ranks that are threads of one process
    (each would wait in its allocations for a peer's spinning kernel): every member raises
    Unusable saying so, after the exchange, and frees what it allocated.  Members whose
    process tokens differ (other processes, even where pids repeat) go on to map."""
    from types import SimpleNamespace

    from chorus.cuda import workspace
    from chorus.store import HashStore

    closed = []

    def fake_init(self, pg, total):  # the allocation, without a GPU
        self.rank, self.ptr, self.device = pg.rank(), 1000 + pg.rank(), SimpleNamespace(index=pg.rank())
        self.phases, self.mapped = {}, False

    monkeypatch.setattr(workspace.Workspace, "__init__", fake_init)
    monkeypatch.setattr(workspace.Workspace, "close", lambda self: closed.append(self.rank))
    monkeypatch.setattr(workspace.Workspace, "_map", lambda self, infos: setattr(self, "mapped", True))
    monkeypatch.setattr(workspace.Workspace, "_check", lambda self, store, prefix, timeout: "")
    monkeypatch.setattr(workspace.runtime, "ipc_handle", lambda ptr: b"handle")
    monkeypatch.setattr(workspace.kernels, "warm_keys", lambda: lambda: None)
    store = HashStore()

    def threads(rank, world):
        with pytest.raises(workspace.Unusable, match="some members are threads of one process") as refused:
            workspace.Workspace.create(current().default_group, store, "cuda/0/0", 1 << 20)
        return str(refused.value)

    assert len(set(run_threads(threads, W))) == 1
    assert sorted(closed) == list(range(W))

    def processes(rank, world):  # as if each rank were a process of its own, all with one pid
        tokens[rank] = f"1-{rank}"
        return workspace.Workspace.create(current().default_group, store, "cuda/0/1", 1 << 20).mapped

    tokens = {}
    monkeypatch.setattr(workspace, "process_token", lambda: tokens[current().default_group.rank()])
    assert run_threads(processes, W) == [True] * W


@pytest.mark.parametrize("fails_at", ["host_alloc", "zero"])
def test_a_workspace_whose_making_fails_lets_go_of_what_it_allocated(monkeypatch, fails_at):
    """Workspace.__init__ frees the device memory (and the control page) it got when a
    later step raises: create() has no workspace to close then."""
    import numpy as np

    from chorus.cuda import layout as L
    from chorus.cuda import workspace

    freed = []
    page = np.zeros(L.CONTROL_WORDS, np.int64)

    def host_alloc(nbytes):
        if fails_at == "host_alloc":
            raise MemoryError("no pinned memory")
        return 88

    def zero(*a, **k):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(workspace.runtime, "malloc", lambda nbytes: 77)
    monkeypatch.setattr(workspace.runtime, "host_alloc", host_alloc)
    monkeypatch.setattr(workspace.runtime, "host_words", lambda addr, n: memoryview(page).cast("B").cast("q"))
    monkeypatch.setattr(workspace.runtime, "free", lambda ptr: freed.append(("free", ptr)))
    monkeypatch.setattr(workspace.runtime, "host_free", lambda addr: freed.append(("host_free", addr)))
    monkeypatch.setattr(torch, "as_tensor", zero)
    pg = type("PG", (), {"rank": lambda self: 0, "size": lambda self: 2, "members": (0, 1)})()
    with pytest.raises((MemoryError, RuntimeError)):
        workspace.Workspace(pg, 1 << 20)
    assert freed == ([("free", 77)] if fails_at == "host_alloc" else [("free", 77), ("host_free", 88)])
