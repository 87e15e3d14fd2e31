"""What each GPU process of tests/gpu runs: chorus (CPU backend, for the group and the
store) and torch's NCCL side by side, chorus.cuda attached to chorus's group, Calls
built by hand and handed to the component, results compared with NCCL's and with the
reduce kernel's own rule (float32 accumulation in rank order) — bit for bit."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: cuda_emulation

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
from cuda_emulation import reference  # noqa: E402

import chorus  # noqa: E402
from chorus import recorder  # noqa: E402
from chorus.api.state import current  # noqa: E402
from chorus.call import make  # noqa: E402
from chorus.components.select import device_component  # noqa: E402
from chorus.cuda.component import attach  # noqa: E402

OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
DTYPES = ["float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
DTYPES += [d for d in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, d)]


def init(rank: int, world: int, ports: tuple[int, int], timeout: float = 60.0):
    """NCCL and chorus in this process; chorus.cuda attached to chorus's world group."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world,
                             device_id=torch.device("cuda", rank))
    chorus.init_process_group("chorus", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank,
                              world_size=world, timeout=timeout)
    pg = current().default_group
    return pg, attach(pg)


def finish(comp) -> None:
    torch.cuda.synchronize()
    tdist.barrier()
    comp.close()
    chorus.destroy_process_group()
    tdist.destroy_process_group()


def issue(comp, pg, name, buffers, *, count, dtype, reduce_op="", root=-1, args=None, async_op=False,
          uniform=True, algorithm=None):
    """Build the Call the API would and start it on the component."""
    wire = "uint8" if dtype.startswith("float8") else dtype
    first = next(iter(buffers.values()))
    call = make(pg, name, dtype=wire, count=count, buffers=buffers, async_op=async_op, algorithm=algorithm,
                nbytes=first.numel() * first.element_size(), args=args or {"count": count}, root=root,
                reduce_op=reduce_op, uniform=uniform, result=list(buffers.values()))
    if "device" in call._fields:
        call = call._replace(device="cuda")
    algorithm = comp.supports(call)
    assert algorithm is not None, call.name
    return comp.start(call, algorithm)


def data(rank: int, n: int, dtype: str, salt: int = 0) -> torch.Tensor:
    """Small integers (exact in every dtype and every sum below); bool: a pattern."""
    values = (torch.arange(n, device="cuda") * 7 + rank * 3 + salt) % 4
    if dtype == "bool":
        return values > 1
    if dtype.startswith(("int", "float", "bfloat")) and dtype != "uint8":
        values = values - 1  # negatives too
    return values.to(getattr(torch, dtype))


def gather_all(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Every rank's ``t`` through NCCL (as bytes: any dtype)."""
    raw = t.contiguous().view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(world)]
    tdist.all_gather(parts, raw)
    return [p.view(t.dtype) for p in parts]


def same_everywhere(t: torch.Tensor, world: int) -> None:
    parts = gather_all(t, world)
    assert all(torch.equal(p.view(torch.uint8), parts[0].view(torch.uint8)) for p in parts), "ranks differ"


def valid(op: str, dtype: str) -> bool:
    floating = dtype.startswith("float") or dtype == "bfloat16"
    return not (floating and op in ("BAND", "BOR", "BXOR"))


# -- cases -----------------------------------------------------------------------------------------
def case_all_reduce(rank, world, pg, comp):
    sizes = [1, 1000, 300_001]  # the last takes several rounds of a 4 MiB workspace's slots
    for dtype in DTYPES:
        ops = OPS if dtype in ("int32", "bool", "float32") else ["SUM", "MAX"]
        for op in (o for o in ops if valid(o, dtype)):
            for n in sizes:
                x = data(rank, n, dtype)
                want = reference(gather_all(x, world), op)
                issue(comp, pg, "all_reduce", {"data": x}, count=n, dtype=dtype, reduce_op=op)
                assert torch.equal(x.view(torch.uint8), want.view(torch.uint8)), (dtype, op, n)
                same_everywhere(x, world)
    # differential against NCCL itself (integer-valued: exact in any summation order)
    for dtype in ("float32", "bfloat16", "int64"):
        x = data(rank, 100_000, dtype)
        y = x.clone()
        issue(comp, pg, "all_reduce", {"data": x}, count=x.numel(), dtype=dtype, reduce_op="SUM")
        tdist.all_reduce(y)
        assert torch.equal(x, y), dtype
    # from the hand-off size on (chorus.cuda.nccl.nccl_from: 8 MiB with this test's 4 MiB
    # workspace), on NCCL's kernels (fingerprints agreed first); bitwise ops and bool stay on chorus's
    n = 4_500_001  # 18 MB of float32
    for dtype, op, want_algorithm in (("float32", "SUM", "nccl"), ("float32", "MAX", "nccl"),
                                      ("int32", "BXOR", "two_shot_push"), ("bool", "BOR", "two_shot_push")):
        x = data(rank, n, dtype)
        want = reference(gather_all(x, world), op)
        call_algorithm = comp.supports(make(pg, "all_reduce", dtype=dtype, count=n, buffers={"data": x},
                                            async_op=False, algorithm=None, nbytes=x.numel() * x.element_size(),
                                            args={"count": n}, reduce_op=op)._replace(device="cuda"))
        assert call_algorithm == want_algorithm, (dtype, op, call_algorithm)
        issue(comp, pg, "all_reduce", {"data": x}, count=n, dtype=dtype, reduce_op=op)
        assert torch.equal(x.view(torch.uint8), want.view(torch.uint8)), (dtype, op, n)
    side = torch.cuda.Stream()
    x = data(rank, n, "float32")
    want = reference(gather_all(x, world), "SUM")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # NCCL's kernel must wait for the caller's queued work
        work = issue(comp, pg, "all_reduce", {"data": x}, count=n, dtype="float32", reduce_op="SUM", async_op=True)
    work.wait()
    assert torch.equal(x * 1, want)


def case_rooted(rank, world, pg, comp):
    n = 200_003
    for root in range(world):
        x = data(rank, n, "float32", root)
        ref = x.clone()
        tdist.reduce(ref, dst=root)
        issue(comp, pg, "reduce", {"data": x}, count=n, dtype="float32", reduce_op="SUM", root=root)
        assert torch.equal(x, ref if rank == root else data(rank, n, "float32", root))
        for algorithm in (None, "one_shot"):  # NCCL's kernels (CHORUS_CUDA_NCCL_BROADCAST), chorus's copies
            x = data(rank, n, "bfloat16", root)
            ref = x.clone()
            tdist.broadcast(ref, src=root)
            issue(comp, pg, "broadcast", {"data": x}, count=n, dtype="bfloat16", root=root, algorithm=algorithm)
            assert torch.equal(x, ref), (root, algorithm)
        # through the API, on NCCL's kernels: async, and a non-contiguous tensor (copied back)
        x, strided = data(rank, n, "float32", root), data(rank, 2 * n, "float32", root)[::2]
        ref, ref_strided = x.clone(), strided.clone()
        tdist.broadcast(ref, src=root)
        tdist.broadcast(ref_strided, src=root)
        work = chorus.broadcast(x, src=root, async_op=True)
        chorus.broadcast(strided, src=root)
        work.wait()
        assert torch.equal(x, ref) and torch.equal(strided, ref_strided), root
        inp = data(rank, n, "int32", root)
        out = torch.empty(world * n, dtype=torch.int32, device="cuda")
        ref = torch.empty_like(out)
        tdist.all_gather_into_tensor(ref, inp)
        issue(comp, pg, "all_gather", {"input": inp, "output": out}, count=n, dtype="int32")
        assert torch.equal(out, ref)
        out = torch.full((world * n,), -1, dtype=torch.int32, device="cuda")
        buffers = {"input": inp, **({"output": out} if rank == root else {})}
        issue(comp, pg, "gather", buffers, count=n, dtype="int32", root=root)
        if rank == root:
            assert torch.equal(out, ref)
        src = data(rank, world * n, "float16", 5)
        out = torch.empty(n, dtype=torch.float16, device="cuda")
        ref = torch.empty_like(out)
        tdist.scatter(ref, list(src.chunk(world)) if rank == root else None, src=root)
        issue(comp, pg, "scatter", {"output": out, **({"input": src} if rank == root else {})}, count=n,
              dtype="float16", root=root)
        assert torch.equal(out, ref)
    counts = tuple(100_000 * (r + 1) + r for r in range(world))
    inp = data(rank, sum(counts), "bfloat16")
    out = torch.empty(counts[rank], dtype=torch.bfloat16, device="cuda")
    issue(comp, pg, "reduce_scatter", {"input": inp, "output": out}, count=sum(counts), dtype="bfloat16",
          reduce_op="SUM", args={"counts": counts}, uniform=False)
    start = sum(counts[:rank])
    assert torch.equal(out, reference(gather_all(inp, world), "SUM")[start:start + counts[rank]])
    send = [50_000 * (rank + 2 * j) + j for j in range(world)]
    recv_sizes = torch.tensor(send, device="cuda")
    matrix = gather_all(recv_sizes, world)
    recv = [int(matrix[i][rank]) for i in range(world)]
    inp = data(rank, sum(send), "float32") + 10 * rank
    out = torch.full((sum(recv),), -1.0, device="cuda")
    ref = torch.empty_like(out)
    tdist.all_to_all_single(ref, inp, recv, send)
    for algorithm in (None, "channels"):  # NCCL's (the hand-off), chorus's
        out.fill_(-1.0)
        issue(comp, pg, "all_to_all", {"input": inp, "output": out}, count=0, dtype="float32",
              args={"send_counts": tuple(send), "recv_counts": tuple(recv)}, uniform=False, algorithm=algorithm)
        assert torch.equal(out, ref), algorithm
    issue(comp, pg, "barrier", {"token": torch.empty(0, device="cuda")}, count=0, dtype="bytes")


def case_p2p(rank, world, pg, comp):
    right, left = (rank + 1) % world, (rank - 1) % world
    for n in (0, 3, 2_000_001):  # empty, tiny, several channel chunks
        out = data(rank, n, "float32", 1)
        got = torch.full((n,), -1.0, device="cuda")
        comp.p2p_batch([("send", out, right, 9), ("recv", got, left, 9)], False)
        assert torch.equal(got, data(left, n, "float32", 1)), n
    if rank in (0, 1):  # ordered pair traffic, then (through the channels) a wrong tag
        peer = 1 - rank
        for i in range(3):
            t = torch.full((10,), float(i), device="cuda")
            if rank == 0:
                comp.p2p("send", t, peer, i, False)
            else:
                got = torch.empty(10, device="cuda")
                comp.p2p("recv", got, peer, i, False)
                assert torch.equal(got, t)
        if comp.lanes is None:
            return  # staged: tags are separate streams, as on the CPU; a wrong one never matches
        t = torch.ones(4, device="cuda")
        if rank == 0:
            comp.p2p("send", t, peer, 1, False)
        else:
            comp.p2p("recv", t, peer, 2, False)
            torch.cuda.synchronize()
            try:
                comp.check("after recv")
            except chorus.InvalidArgumentError as exc:
                assert "tag 2" in str(exc) and "tag 1" in str(exc), exc
            else:
                raise AssertionError("a mismatched tag was not reported")


def case_async(rank, world, pg, comp):
    side = torch.cuda.Stream()
    x = data(rank, 500_000, "float32")
    want = reference(gather_all(x, world), "SUM")
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the op must wait for the caller's queued work
        work = issue(comp, pg, "all_reduce", {"data": x}, count=x.numel(), dtype="float32", reduce_op="SUM",
                     async_op=True)
    future = work.get_future()
    work.wait()  # the current (default) stream waits; the CPU does not
    y = x * 1  # ordered after the op on the default stream
    work.synchronize()
    assert work.is_completed() and work.is_success()
    assert torch.equal(y, want) and torch.equal(future.wait()[0], want)
    events = []
    recorder.attach(events.append)
    try:
        issue(comp, pg, "all_reduce", {"data": x}, count=x.numel(), dtype="float32", reduce_op="MAX")
        issue(comp, pg, "broadcast", {"data": x}, count=x.numel(), dtype="float32", root=0, algorithm="one_shot")
    finally:
        recorder.detach()
    kinds = {(e.what, e.component) for e in events}
    # all_reduce: one fused kernel per round ("reduce"); broadcast: copies and barriers
    assert {("begin", "cuda"), ("copy", "cuda"), ("sync", "cuda"), ("reduce", "cuda"), ("end", "cuda")} <= kinds


def case_nccl_gather(rank, world, pg, comp):
    """CHORUS_CUDA_NCCL_GATHER_FROM_BYTES set (here, before a new group's first CUDA call):
    all_gather_into_tensor and reduce_scatter_tensor from that size on NCCL's kernels,
    equal to NCCL's own; below it, chorus's fused kernels."""
    os.environ["CHORUS_CUDA_NCCL_GATHER_FROM_BYTES"] = str(8 << 20)
    try:
        group = chorus.new_group(list(range(world)))
        for n in (1000, 1 << 20):  # blocks per rank: 4 KB (fused kernels) and 4 MiB (NCCL)
            inp = data(rank, n, "float32")
            out, want = torch.empty(n * world, device="cuda"), torch.empty(n * world, device="cuda")
            chorus.all_gather_into_tensor(out, inp, group=group)
            tdist.all_gather_into_tensor(want, inp)
            torch.cuda.synchronize()
            assert torch.equal(out, want), ("all_gather", n)
            big = data(rank, n * world, "float32")
            part, want = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
            chorus.reduce_scatter_tensor(part, big, group=group)
            tdist.reduce_scatter_tensor(want, big)
            torch.cuda.synchronize()
            assert torch.equal(part, want), ("reduce_scatter", n)
            made = device_component(group, "cuda")._nccl is not None  # the communicator, made at NCCL's first op
            assert made == (n * world * 4 >= 8 << 20), (n, made)
        chorus.destroy_process_group(group)
    finally:
        del os.environ["CHORUS_CUDA_NCCL_GATHER_FROM_BYTES"]


def case_graph(rank, world, pg, comp):
    """all_reduces captured in one CUDA graph (one-shot, two-shot, NCCL-sized, several rounds
    of the graph slots, AVG), replayed with new inputs three times, eager calls between:
    every replay's results equal NCCL's; other ops inside a capture are refused."""
    sizes = [1000, 600_000, 3_000_001]  # one-shot; two-shot, in graph-slot rounds; NCCL's
    bufs = [data(rank, n, "float32") for n in sizes] + [data(rank, 5000, "bfloat16")]
    ops = [chorus.ReduceOp.SUM, chorus.ReduceOp.SUM, chorus.ReduceOp.MAX, chorus.ReduceOp.AVG]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch's recipe asks
        for b, op in zip(bufs, ops, strict=True):
            chorus.all_reduce(b, op=op)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for b, op in zip(bufs, ops, strict=True):
            chorus.all_reduce(b, op=op)
    for salt in range(3):
        inputs = [data(rank, b.numel(), str(b.dtype)[6:], salt) for b in bufs]
        wants = []
        for x, op in zip(inputs, ops, strict=True):
            want = x.clone()
            tdist.all_reduce(want, op=getattr(tdist.ReduceOp, op.name))
            wants.append(want)
        for b, x in zip(bufs, inputs, strict=True):
            b.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        for b, want in zip(bufs, wants, strict=True):
            assert torch.equal(b, want), (salt, b.numel(), b.dtype)
        eager = data(rank, 2000, "float32", salt)
        want = eager.clone()
        tdist.all_reduce(want)
        chorus.all_reduce(eager)
        assert torch.equal(eager, want), salt
    refused = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(refused):
            chorus.broadcast(bufs[0], src=0)
    except chorus.InvalidArgumentError as exc:
        assert "cannot be captured" in str(exc), exc
    else:
        raise AssertionError("a captured broadcast was accepted")
    torch.cuda.synchronize()


def case_replay(rank, world, pg, comp):
    """all_reduces repeated on the same tensors run, from a tensor's third call of a slot
    parity on, as replays of their CUDA graphs (chorus.cuda.replays), between eager calls
    on fresh tensors and an op of another kind: every result equals NCCL's."""
    bufs = [data(rank, n, "float32") for n in (1000, 100_000)] + [data(rank, 5000, "bfloat16")]
    for salt in range(7):
        for b in bufs:
            x = data(rank, b.numel(), str(b.dtype)[6:], salt)
            want = x.clone()
            tdist.all_reduce(want)
            b.copy_(x)
            chorus.all_reduce(b)
            assert torch.equal(b, want), (salt, b.numel(), b.dtype)
        fresh = data(rank, 3000 + salt, "float32", salt)  # (a new address, and a new shape, each time)
        want = fresh.clone()
        tdist.all_reduce(want)
        chorus.all_reduce(fresh)
        assert torch.equal(fresh, want), salt
        if salt == 3:
            root = data(rank, 64, "float32")
            chorus.broadcast(root, src=0)
            want = data(0, 64, "float32")
            assert torch.equal(root, want)
    lanes = pg.device_components["cuda"].lanes  # (the API's component: run() attached another)
    made = [shot.replays for shot in lanes.shots.values() if shot.replays]
    replayed = [one for one in made if any(one.kept.values())]
    assert len(replayed) == 3, [one.kept for one in made]


def case_rows_replay(rank, world, pg, comp):
    """all_gather_into_tensor and reduce_scatter_tensor repeated on the same buffers (fresh
    data each time) replay their CUDA graphs from a buffer pair's third call of a slot
    parity on, between calls on fresh buffers and an all_reduce: every result equals
    NCCL's, and each repeated plan kept a graph."""
    n = 2048
    ins = {"all_gather": data(rank, n, "bfloat16"), "reduce_scatter": data(rank, world * n, "float32")}
    outs = {"all_gather": torch.empty(world * n, dtype=torch.bfloat16, device="cuda"),
            "reduce_scatter": torch.empty(n, dtype=torch.float32, device="cuda")}
    for salt in range(7):
        for name, inp in ins.items():
            inp.copy_(data(rank, inp.numel(), str(inp.dtype)[6:], salt))
            want = torch.empty_like(outs[name])
            if name == "all_gather":
                tdist.all_gather_into_tensor(want, inp.clone())
                chorus.all_gather_into_tensor(outs[name], inp)
            else:
                tdist.reduce_scatter_tensor(want, inp.clone())
                chorus.reduce_scatter_tensor(outs[name], inp)
            assert torch.equal(outs[name], want), (name, salt)
        fresh = data(rank, 300 + salt, "float32", salt)  # (another plan, on fresh buffers)
        gathered, want = (torch.empty(world * fresh.numel(), device="cuda") for _ in range(2))
        tdist.all_gather_into_tensor(want, fresh)
        chorus.all_gather_into_tensor(gathered, fresh)
        assert torch.equal(gathered, want), salt
        chorus.all_reduce(fresh)
    lanes = pg.device_components["cuda"].lanes
    kinds = [shot.kind for shot in lanes.shots.values() if shot.replays and any(shot.replays.kept.values())]
    assert sorted(kinds) == ["all_gather", "reduce_scatter"], kinds


def case_rows(rank, world, pg, comp):
    """all_gather_into_tensor and reduce_scatter_tensor repeated (bf16 and float32; SUM,
    AVG, MAX), sync and async, through the API's CUDA lane (rows_now) on even ranks and
    the general path on odd ones (their lane turned away: the API's own routing), mixed
    in one group: every result equals NCCL's, and the lane took the even ranks' calls."""
    chorus.all_reduce(data(rank, 8, "float32"))  # (the API's component exists from here)
    api = pg.device_components["cuda"]
    took: list = []
    lane = api.rows_now
    if rank % 2:
        api.rows_now = lambda *args: took.append(False) or False
    else:
        api.rows_now = lambda *args: took.append(lane(*args)) or took[-1]
    for dtype, n in (("bfloat16", 4096), ("float32", 1000)):
        for salt, op in enumerate((chorus.ReduceOp.SUM, chorus.ReduceOp.AVG, chorus.ReduceOp.MAX) * 2):
            x = data(rank, world * n, dtype, salt)
            out = torch.empty(n, dtype=x.dtype, device="cuda")
            want = torch.empty_like(out)
            tdist.reduce_scatter_tensor(want, x.clone(), op=getattr(tdist.ReduceOp, op.name))
            work = chorus.reduce_scatter_tensor(out, x, op=op, async_op=salt % 2 == 1)
            if work is not None:
                work.wait()
            assert torch.equal(out, want), (dtype, op, salt)
            y = data(rank, n, dtype, salt)
            gathered = torch.empty(world * n, dtype=y.dtype, device="cuda")
            want = torch.empty_like(gathered)
            tdist.all_gather_into_tensor(want, y)
            work = chorus.all_gather_into_tensor(gathered, y, async_op=salt % 2 == 0)
            if work is not None:
                work.wait()
            assert torch.equal(gathered, want), (dtype, salt)
    api.rows_now = lane
    assert len(took) == 24 and all(took) == (rank % 2 == 0), took


def run(rank, world, ports, cases):
    pg, comp = init(rank, world, ports)
    staged = os.environ.get("CHORUS_CUDA_STAGING") == "1"
    assert (comp.lanes is None) == staged, comp.staging_reason
    for name in cases:
        globals()[f"case_{name}"](rank, world, pg, comp)
        torch.cuda.synchronize()
        comp.check(name)
    finish(comp)


def run_ptx_unavailable(rank, world, ports):
    """The workspace check's PTX kernel does not load on any rank: Triton's reduction
    reads the peers' patterns instead, the workspace is kept, and ops run through it."""
    from chorus.cuda import peer_sum

    def refuse(*args, **kwargs):
        raise peer_sum.PeerSumUnavailable("refused for the test")

    peer_sum.sum_rows = refuse
    pg, comp = init(rank, world, ports)
    assert comp.lanes is not None, comp.staging_reason
    case_all_reduce(rank, world, pg, comp)
    torch.cuda.synchronize()
    comp.check("ptx_unavailable")
    finish(comp)


def run_write_fails(rank, world, ports):
    """Rank 1's copies into the peers' workspaces fail during the check: every rank
    stages through host memory, each told that rank 1's write failed, and ops still
    match NCCL."""
    from chorus.cuda.workspace import Workspace

    if rank == 1:
        def refuse(self, stream):
            raise RuntimeError("copy refused for the test")

        Workspace._write_pattern = refuse
    pg, comp = init(rank, world, ports)
    assert comp.lanes is None, "the workspace was kept although rank 1 could not write"
    assert "rank 1" in comp.staging_reason and "writing into peers' workspaces failed" in comp.staging_reason, \
        comp.staging_reason
    case_rooted(rank, world, pg, comp)
    torch.cuda.synchronize()
    comp.check("write_fails")
    finish(comp)


def run_timeout(rank, world, ports):
    """Rank 1 skips an all_reduce: rank 0's spin gives up at the group's timeout and the
    error names the op and rank 1; later calls fail fast."""
    import time

    pg, comp = init(rank, world, ports, timeout=3.0)
    x = data(rank, 10, "float32")
    if rank == 0:
        start = time.monotonic()
        issue(comp, pg, "all_reduce", {"data": x}, count=10, dtype="float32", reduce_op="SUM")
        torch.cuda.synchronize()
        assert time.monotonic() - start < 30
        for _ in range(2):
            try:
                issue(comp, pg, "all_reduce", {"data": x}, count=10, dtype="float32", reduce_op="SUM")
            except chorus.CommTimeoutError as exc:
                assert "all_reduce" in str(exc) and "[1]" in str(exc), exc
            else:
                raise AssertionError("no timeout reported")
    tdist.barrier()
    comp.close()
    chorus.destroy_process_group()
    tdist.destroy_process_group()


def run_replay_timeout(rank, world, ports, name="all_reduce"):
    """Rank 1 skips the sixth of an op (``name``: all_reduce, or all_gather_into_tensor)
    repeated on one tensor: rank 0's replayed kernel gives up at the group's timeout,
    reporting its op by its epoch, and the error names that op (its sequence number), not
    the op the graph was captured for."""
    from chorus.cuda import layout as L

    pg, attached = init(rank, world, ports, timeout=3.0)
    attached.close()
    x = data(rank, 1000, "float32")
    out = torch.empty(world * 1000, device="cuda")

    def op():
        if name == "all_reduce":
            chorus.all_reduce(x)
        else:
            chorus.all_gather_into_tensor(out, x)

    for _ in range(5):
        op()
    torch.cuda.synchronize()
    comp = pg.device_components["cuda"]  # (the component the API made at its first CUDA op)
    if rank == 0:
        op()
        failed = comp.names.entry(comp.names.last)
        torch.cuda.synchronize()
        assert int(comp.ws.words[L.FAIL_OP]) >= L.REPLAY_OP, int(comp.ws.words[L.FAIL_OP])
        try:
            op()
        except chorus.CommTimeoutError as exc:
            assert failed[0] in str(exc) and "[1]" in str(exc), (failed, exc)
        else:
            raise AssertionError("no timeout reported")
    tdist.barrier()
    chorus.destroy_process_group()
    tdist.destroy_process_group()


def run_abort(rank, world, ports, ahead):
    """Rank 1 skips an all_reduce; rank 0's fused kernel spins until the CPU sets the
    control page's ABORT a second later, then gives up long before the group's timeout,
    and the next call raises AbortedError.  ``ahead``: rank 0's HOST_POLL word (the time
    of its last host-page read) holds a time far ahead of the GPU's clock first, which
    must count as due, not as never due."""
    import threading
    import time

    from chorus.cuda import layout as L
    from chorus.cuda import runtime

    pg, comp = init(rank, world, ports, timeout=60.0)
    x = data(rank, 1 << 16, "float32")  # (a fused kernel of several blocks)
    if rank == 0:
        if ahead:
            word = torch.as_tensor(runtime.DeviceArray(comp.ws.bases[rank] + L.HOST_POLL, 8), device=x.device)
            word.view(torch.int64).fill_(1 << 62)
            torch.cuda.synchronize()
        start = time.monotonic()
        threading.Timer(1.0, lambda: comp.ws.words.__setitem__(L.ABORT, 1)).start()
        issue(comp, pg, "all_reduce", {"data": x}, count=1 << 16, dtype="float32", reduce_op="SUM",
              algorithm="two_shot_push")
        torch.cuda.synchronize()
        took = time.monotonic() - start
        assert 0.9 < took < 15, f"the spin ended after {took:.1f} s (ABORT set at 1 s, timeout 60 s)"
        try:
            issue(comp, pg, "all_reduce", {"data": x}, count=1 << 16, dtype="float32", reduce_op="SUM")
        except chorus.AbortedError as exc:
            assert "all_reduce" in str(exc), exc
        else:
            raise AssertionError("no abort reported")
    finish(comp)
