"""chorus.cuda's algorithms and executor on the CPU (tests/cuda_emulation.py): every
collective, uneven sizes, chunking through small workspaces, against torch references."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cuda_emulation import Group, reference  # noqa: E402

from chorus.cuda import algorithms as A  # noqa: E402
from chorus.cuda import layout as L  # noqa: E402

SMALL = L.CONTROL_BYTES + 16384  # slots of 4 KiB: messages of a few KiB take several rounds
DTYPES = ["float32", "bfloat16", "float16", "int64", "int8", "uint8", "bool", "float64"]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def data(rank: int, n: int, dtype: str, salt: int = 0) -> torch.Tensor:
    values = (torch.arange(n) * 7 + rank * 3 + salt) % 5
    if dtype == "bool":
        return values > 2
    return values.to(getattr(torch, dtype))


def ptr(t):
    return t.data_ptr()


def valid(op: str, dtype: str) -> bool:
    floating = dtype.startswith("float") or dtype == "bfloat16"
    return not (floating and op in ("BAND", "BOR", "BXOR"))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_every_op(world, dtype):
    g = Group(world, SMALL)
    n = 3000  # several rounds for every dtype
    for op in filter(lambda o: valid(o, dtype), OPS):
        ins = [data(r, n, dtype) for r in range(world)]
        bufs = [t.clone() for t in ins]

        def body(x, op=op, bufs=bufs):
            x.begin(1, None, 0, dtype, op)
            A.all_reduce(x, ptr(bufs[x.rank]), n, bufs[x.rank].element_size())

        g.run(body)
        want = reference(ins, op)
        for r in range(world):
            assert torch.equal(bufs[r], want), (op, r)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rooted_and_gathering(world):
    g = Group(world, SMALL)
    n = 1500
    for root in range(world):
        ins = [data(r, n, "float32", root) for r in range(world)]
        b = dict(red=[t.clone() for t in ins], bc=[t.clone() for t in ins],
                 ag=[torch.empty(world * n) for _ in range(world)],
                 ga=[torch.full((world * n,), -1.0) for _ in range(world)],
                 sc_in=[data(r, world * n, "float32", 9) for r in range(world)],
                 sc=[torch.empty(n) for _ in range(world)], ins=ins)

        def body(x, root=root, b=b):
            r = x.rank
            x.begin(1, None, 0, "float32", "SUM")
            A.reduce(x, ptr(b["red"][r]), n, 4, root)
            A.broadcast(x, ptr(b["bc"][r]), n, 4, root)
            A.all_gather(x, ptr(b["ins"][r]), ptr(b["ag"][r]), n, 4)
            A.all_gather(x, ptr(b["ins"][r]), ptr(b["ga"][r]) if r == root else None, n, 4, root)
            A.scatter(x, ptr(b["sc_in"][r]) if r == root else None, ptr(b["sc"][r]), n, 4, root)

        g.run(body)
        total = reference(ins, "SUM")
        for r in range(world):
            assert torch.equal(b["red"][r], total if r == root else ins[r])
            assert torch.equal(b["bc"][r], ins[root])
            assert torch.equal(b["ag"][r], torch.cat(ins))
            assert torch.equal(b["ga"][r], torch.cat(ins) if r == root else torch.full((world * n,), -1.0))
            assert torch.equal(b["sc"][r], b["sc_in"][root][r * n:(r + 1) * n])


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "int32"])
def test_reduce_scatter_uneven(world, dtype):
    g = Group(world, SMALL)
    counts = tuple(700 * (r + 1) + r for r in range(world))  # several rounds, one rank at zero below
    for cs in (counts, (0,) + counts[1:]):
        ins = [data(r, sum(cs), dtype) for r in range(world)]
        outs = [torch.zeros(cs[r], dtype=getattr(torch, dtype)) for r in range(world)]

        def body(x, cs=cs, outs=outs, ins=ins):
            x.begin(1, None, 0, dtype, "SUM")
            A.reduce_scatter(x, ptr(ins[x.rank]), ptr(outs[x.rank]), cs, ins[x.rank].element_size())

        g.run(body)
        total = reference(ins, "SUM")
        start = 0
        for r in range(world):
            assert torch.equal(outs[r], total[start:start + cs[r]])
            start += cs[r]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fused_all_gather_and_reduce_scatter(world):
    """The one-kernel rounds (chorus.cuda.gather): blocks of sizes that do not divide into
    rounds or rows evenly, between other collectives sharing the epochs and slots."""
    g = Group(world, SMALL)
    for n, dtype in ((1, "float32"), (1500, "float32"), (4099, "bfloat16"), (777, "int32")):
        ins = [data(r, n, dtype) for r in range(world)]
        rs_ins = [data(r, world * n, dtype, 3) for r in range(world)]
        dt = getattr(torch, dtype)
        ag = [torch.full((world * n,), 7, dtype=dt) for _ in range(world)]
        rs = [torch.zeros(n, dtype=dt) for _ in range(world)]
        bc = [t.clone() for t in ins]

        def body(x, n=n, dtype=dtype, ins=ins, rs_ins=rs_ins, ag=ag, rs=rs, bc=bc):
            r = x.rank
            item = ins[r].element_size()
            x.begin(1, None, 0, dtype, "")
            A.all_gather(x, ptr(ins[r]), ptr(ag[r]), n, item, fused=True)
            x.begin(2, None, 0, dtype, "SUM")
            A.reduce_scatter(x, ptr(rs_ins[r]), ptr(rs[r]), (n,) * world, item, fused=True)
            x.begin(3, None, 0, dtype, "")
            A.broadcast(x, ptr(bc[r]), n, item, 0)
            return x.epoch

        assert len(set(g.run(body))) == 1
        total = reference(rs_ins, "SUM")
        for r in range(world):
            assert torch.equal(ag[r], torch.cat(ins)), (n, r)
            assert torch.equal(rs[r], total[r * n:(r + 1) * n]), (n, r)
            assert torch.equal(bc[r], ins[0]), (n, r)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_to_all_uneven(world):
    g = Group(world, SMALL)
    # rank i sends (i + 2 j) * 500 + j elements to rank j: some blocks span several channel chunks
    sizes = [[(i + 2 * j) * 500 + j for j in range(world)] for i in range(world)]
    sizes[0][world - 1] = 0
    ins = [data(i, sum(sizes[i]), "float32") + 100 * i for i in range(world)]
    outs = [torch.full((sum(sizes[i][j] for i in range(world)),), -1.0) for j in range(world)]

    def body(x):
        j = x.rank
        x.begin(1, None, 0, "float32", "")
        for _ in range(2):  # twice: the channel counters carry over
            A.all_to_all(x, ptr(ins[j]), ptr(outs[j]), sizes[j], [sizes[i][j] for i in range(world)], 4)

    g.run(body)
    for j in range(world):
        parts = [ins[i][sum(sizes[i][:j]):sum(sizes[i][:j + 1])] for i in range(world)]
        assert torch.equal(outs[j], torch.cat(parts))


def test_p2p_tags_and_batches():
    g = Group(2, SMALL)
    big = data(0, 5000, "float32")  # ~6 channel chunks
    got, small_got = torch.zeros(5000), torch.zeros(3)

    def body(x):
        x.begin(1, None, 0)
        if x.rank == 0:
            A.exchange(x, [(1, ptr(big), big.nbytes, 7)], [], True)
            A.exchange(x, [(1, ptr(big), 0, 8)], [], True)  # empty message: still matched
            A.exchange(x, [(1, ptr(big), 12, 9)], [(1, ptr(small_got), 12, 10)], True)
        else:
            A.exchange(x, [], [(0, ptr(got), got.nbytes, 7)], True)
            A.exchange(x, [], [(0, ptr(got), 0, 8)], True)
            A.exchange(x, [(0, ptr(big), 12, 10)], [(0, ptr(got), 12, 99)], True)  # wrong tag

    g.run(body)
    assert torch.equal(got, big)
    assert torch.equal(small_got, big[:3])
    host = g.hosts[1]
    assert host[L.STATUS] == 0 and host[L.TAG_OP] == 2  # op id 1, recorded, not fatal
    assert (host[L.TAG_EXPECT], host[L.TAG_GOT], host[L.TAG_PEER]) == (99, 9, 0)


def test_size_mismatch_breaks_and_timeout_is_bounded():
    g = Group(2, SMALL)
    for k in (k for lanes in g.lanes for k in [lanes.k]):
        k.timeout_s = 0.5
    src, dst = torch.ones(10), torch.zeros(20)

    def body(x):
        x.begin(5, None, 0)
        if x.rank == 0:
            A.exchange(x, [(1, ptr(src), src.nbytes, 1)], [], True)
        else:
            A.exchange(x, [], [(0, ptr(dst), dst.nbytes, 1)], True)

    g.run(body)
    host = g.hosts[1]
    assert (host[L.STATUS], host[L.FAIL_EXPECT], host[L.FAIL_GOT], host[L.FAIL_OP]) == (L.SIZE_MISMATCH, 80, 40, 5)

    g = Group(2, SMALL)
    g.lanes[0].k.timeout_s = 0.3

    def alone(x):
        if x.rank == 0:
            x.begin(3, None, 0)
            x.barrier()
            x.barrier()  # skipped: the group is broken

    g.run(alone)
    host = g.hosts[0]
    assert (host[L.STATUS], host[L.FAIL_PEERS], host[L.FAIL_OP]) == (L.TIMEOUT, 0b10, 3)


@pytest.mark.parametrize("world", [2, 4])
def test_mismatched_collectives_stop_at_the_first_barrier(world):
    """Rank 1 all-gathers where the others all-reduce (each op's barriers carry its
    fingerprint): every rank sees MISMATCH at the first barrier, with the other side's
    ranks and fingerprint, and the rest of the op does not wait (no timeout)."""
    from chorus.wire.fingerprint import fingerprint

    g = Group(world, SMALL)
    n = 3000  # several rounds: later barriers are skipped once the page holds the mismatch
    reduce_fp = fingerprint("all_reduce", "float32", n, -1, "SUM")
    gather_fp = fingerprint("all_gather", "float32", n)
    ins = [data(r, n, "float32") for r in range(world)]
    out = torch.empty(world * n)

    def body(x):
        if x.rank == 1:
            x.begin(4, None, 0, "float32", "", gather_fp)
            A.all_gather(x, ptr(ins[1]), ptr(out), n, 4)
        else:
            x.begin(4, None, 0, "float32", "SUM", reduce_fp)
            A.all_reduce(x, ptr(ins[x.rank]), n, 4)

    g.run(body, timeout=20)
    for r in range(world):
        host = g.hosts[r]
        assert (host[L.STATUS], host[L.FAIL_OP]) == (L.MISMATCH, 4), r
        if r == 1:  # everyone else differs from rank 1; the lowest is named
            assert host[L.FAIL_PEERS] == (1 << world) - 1 - 0b10 and host[L.FAIL_FP] == reduce_fp
        else:
            assert host[L.FAIL_PEERS] == 0b10 and host[L.FAIL_FP] == gather_fp


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot", "two_shot_push", "two_shot_stores", "copy_reduce"])
def test_all_reduce_algorithms_rounds_and_epochs(world, algorithm):
    """Each all_reduce algorithm, in several rounds of a small slot, between other
    collectives (whose barriers share the epochs), for sizes that do not divide evenly."""
    g = Group(world, SMALL)
    sizes = [1, 63, 3000, 5001]  # 5001 bf16: three one-shot rounds, more two-shot ones
    for dtype in ("bfloat16", "int32"):
        ins = {n: [data(r, n, dtype, n) for r in range(world)] for n in sizes}
        bufs = {n: [t.clone() for t in ins[n]] for n in sizes}
        gathered = [torch.empty(world * 100) for _ in range(world)]
        small = [data(r, 100, "float32") for r in range(world)]

        def body(x, bufs=bufs, dtype=dtype, gathered=gathered, small=small):
            for n in sizes:
                x.begin(1, None, 0, dtype, "SUM")
                A.all_reduce(x, ptr(bufs[n][x.rank]), n, bufs[n][x.rank].element_size(), algorithm)
                x.begin(2, None, 0, "float32", "")
                A.all_gather(x, ptr(small[x.rank]), ptr(gathered[x.rank]), 100, 4)
                x.barrier()
            return x.epoch

        epochs = g.run(body)
        assert len(set(epochs)) == 1
        for n in sizes:
            want = reference(ins[n], "SUM")
            for r in range(world):
                assert torch.equal(bufs[n][r], want), (dtype, n, r)
        for r in range(world):
            assert torch.equal(gathered[r], torch.cat(small))


def test_all_reduce_picks_by_size():
    assert A.all_reduce_algorithm(8, 4) == "one_shot"
    assert A.all_reduce_algorithm(A.ONE_SHOT_MAX_BYTES - 1, 4) == "one_shot"
    assert A.all_reduce_algorithm(A.ONE_SHOT_MAX_BYTES, 4) == "two_shot_push"
    assert A.all_reduce_algorithm(A.ONE_SHOT_MAX_BYTES // 2, 8) == "two_shot_push"
    assert A.all_reduce_algorithm(1 << 30, 4) == "two_shot_push"
    assert A.all_reduce_algorithm(1 << 30, 1) == "one_shot"


@pytest.mark.parametrize("world", [2, 4])
def test_fused_all_reduce_meets_a_mismatched_barrier(world):
    """Rank 1 runs a two-shot all_reduce where the others all-gather: block 0 of the fused
    kernel and the barrier kernel meet at the same epoch and compare fingerprints."""
    from chorus.wire.fingerprint import fingerprint

    g = Group(world, SMALL)
    n = 3000
    reduce_fp = fingerprint("all_reduce", "float32", n, -1, "SUM")
    gather_fp = fingerprint("all_gather", "float32", n)
    ins = [data(r, n, "float32") for r in range(world)]
    out = [torch.empty(world * n) for _ in range(world)]

    def body(x):
        if x.rank == 1:
            x.begin(4, None, 0, "float32", "SUM", reduce_fp)
            A.all_reduce(x, ptr(ins[1]), n, 4, "two_shot")
        else:
            x.begin(4, None, 0, "float32", "", gather_fp)
            A.all_gather(x, ptr(ins[x.rank]), ptr(out[x.rank]), n, 4)

    g.run(body, timeout=30)
    for r in range(world):
        host = g.hosts[r]
        assert (host[L.STATUS], host[L.FAIL_OP]) == (L.MISMATCH, 4), r
        assert host[L.FAIL_FP] == (gather_fp if r == 1 else reduce_fp)


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot_push", "auto"])
def test_captured_all_reduce_runs_through_the_graph_slots(algorithm):
    """Captured in a CUDA graph (x.graph), all_reduce runs in rounds of a graph slot, its
    launches counted on the device (GRAPH_OPS, GRAPH_EPOCH): the eager rounds and epochs
    stay where they were, so eager ops before and after are unaffected."""
    world, n, dtype = 3, 3000, "float32"
    g = Group(world, SMALL)
    ins = [data(r, n, dtype) for r in range(world)]
    bufs = [t.clone() for t in ins]
    eager = [t.clone() for t in ins]

    def body(x):
        x.begin(1, None, 0, dtype, "SUM")
        A.all_reduce(x, ptr(eager[x.rank]), n, 4)
        before = (x.rounds, x.epoch)
        x.graph = True
        try:
            x.begin(2, None, 0, dtype, "SUM")
            A.all_reduce(x, ptr(bufs[x.rank]), n, 4, algorithm)
        finally:
            x.graph = False
        assert (x.rounds, x.epoch) == before
        x.begin(3, None, 0, dtype, "MAX")
        A.all_reduce(x, ptr(eager[x.rank]), n, 4)
        return x.layout.graph

    graph_slot = g.run(body)[0]
    rounds = -(-n * 4 // graph_slot) if algorithm == "one_shot" else None
    for r in range(world):
        assert torch.equal(bufs[r], reference(ins, "SUM")), r
        assert torch.equal(eager[r], reference(ins, "SUM")), r  # MAX over equal values
        ops = int(g.memories[r][L.GRAPH_OPS: L.GRAPH_OPS + 8].view("int64")[0])
        assert ops >= 2 and (rounds is None or ops == rounds), (ops, rounds)


@pytest.mark.parametrize("nbytes, want", [
    (2 << 20, 8), ((4 << 20) - 2, 8),  # under MID_FROM_BYTES
    (4 << 20, 16), (8 << 20, 16), ((64 << 20) - 2, 16),  # MID_PER_THREAD from 4 MiB
    (64 << 20, 32),  # WIDE_PER_THREAD from 64 MiB
])
def test_two_shot_threads_move_more_elements_a_step_as_messages_grow(nbytes, want):
    """all_reduce's two-shot launches pass the per-thread width of the message's size."""
    from types import SimpleNamespace

    launches = []
    x = SimpleNamespace(world=4, slot_bytes=lambda: 1 << 30, round=lambda: None,
                        all_reduce_fused=lambda kind, inp, out, n, per_thread: launches.append((kind, n, per_thread)))
    A.all_reduce(x, 0, nbytes // 2, 2, "two_shot_push")
    assert launches == [("two_shot_push", nbytes // 2, want)]
