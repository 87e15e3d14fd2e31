"""Every collective through the shared-memory window (ranks as threads, each with its own
mapping of the window), against numpy references: every dtype family x reduce op x
world size, one-shot and reduce-scatter + all-gather, messages that cross the one-shot
threshold and the slot size (chunking), uneven all_to_all, async ops, sub-groups."""

import dataclasses

import numpy as np
import pytest

import chorus as dist
import chorus.shm.collectives as shm_algo
import chorus.shm.phases as shm_phases
from chorus import config
from chorus.testing import run_threads

torch = pytest.importorskip("torch")

WORLDS = [1, 2, 3, 4, 8]
DTYPES = ["int32", "float32", "float16", "bool", "complex64", "bfloat16"]
OPS = {
    "int": ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"],
    "bool": ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"],
    "float": ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"],
    "complex": ["SUM", "PRODUCT", "AVG", "PREMUL_SUM"],
}


def family(dtype):
    return {"int32": "int", "bool": "bool", "complex64": "complex"}.get(dtype, "float")


def values(rank, n, dtype, op="SUM", salt=0):
    """Small exact numbers: sums and products of 8 ranks stay exact in float16/bfloat16."""
    i = np.arange(n) + salt
    if dtype == "bool":
        return (rank + i) % 3 == 0
    v = 1 + (rank + i) % 2 if op == "PRODUCT" else (rank * 7 + i * 3) % 11 - 5
    if dtype == "complex64":
        return (v * np.where((rank + i) % 3 == 0, 1j, 1)).astype(np.complex64)
    return v.astype("float32" if dtype == "bfloat16" else dtype)


def tensor(arr, dtype):
    """numpy for numpy dtypes; a torch bfloat16 tensor for bfloat16."""
    return torch.tensor(arr, dtype=torch.bfloat16) if dtype == "bfloat16" else arr.copy()


def as_np(t):
    return t.float().numpy() if isinstance(t, torch.Tensor) else t


def reference(rows, op, world):
    """The reduction of ``rows`` (one per rank) by ``op``, in numpy."""
    if rows.dtype == bool:
        fn = {"SUM": np.logical_or, "PRODUCT": np.logical_and, "MIN": np.logical_and,
              "MAX": np.logical_or, "BAND": np.logical_and, "BOR": np.logical_or, "BXOR": np.logical_xor}[op]
        return fn.reduce(rows, axis=0)
    if op == "AVG":
        return rows.sum(axis=0) / world
    if op == "PREMUL_SUM":
        return (rows * 0.5).sum(axis=0)
    fn = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
          "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
    return fn.reduce(rows, axis=0)


def reduce_op(op):
    return dist._make_nccl_premul_sum(0.5) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)


def close(got, want, dtype, op):
    if op == "AVG":
        tol = 1e-2 if dtype in ("float16", "bfloat16") else 1e-6
        return np.allclose(got, want, rtol=tol, atol=tol)
    return np.array_equal(np.asarray(got, dtype=want.dtype), want)


class ShmCounter:
    """Asserts that ops really ran over the group's shared-memory window."""

    def __init__(self, group=None):
        self.pg = group if group is not None else dist.group.WORLD
        assert self.pg.shm is not None, "the group has no shared-memory window"
        self.start = self.pg.shm.sync.count

    def ran(self) -> int:
        return self.pg.shm.sync.count - self.start


def reductions(rank, world, dtype, n):
    """all_reduce, reduce (two roots), reduce_scatter for every op of the dtype's family."""
    wrong = []
    for op in OPS[family(dtype)]:
        rows = np.stack([values(r, n, dtype, op) for r in range(world)])
        want = reference(rows, op, world)
        t = tensor(rows[rank], dtype)
        dist.all_reduce(t, op=reduce_op(op))
        if not close(as_np(t), want, dtype, op):
            wrong.append(("all_reduce", op, as_np(t), want))
        for root in {0, world - 1}:
            t = tensor(rows[rank], dtype)
            dist.reduce(t, dst=root, op=reduce_op(op))
            expect = want if rank == root else rows[rank].astype(want.dtype)
            if not close(as_np(t), expect, dtype, op):
                wrong.append(("reduce", op, root, as_np(t), expect))
        big = np.stack([np.concatenate([values(r, n, dtype, op, salt=q) for q in range(world)])
                        for r in range(world)])
        out = tensor(np.zeros(n, big.dtype), dtype)
        dist.reduce_scatter_tensor(out, tensor(big[rank], dtype), op=reduce_op(op))
        expect = reference(big, op, world)[rank * n:(rank + 1) * n]
        if not close(as_np(out), expect, dtype, op):
            wrong.append(("reduce_scatter", op, as_np(out), expect))
    return wrong


def movements(rank, world, dtype, n):
    """broadcast, all_gather (list and tensor), gather, scatter (two roots), all_to_all, barrier."""
    wrong = []
    mine = values(rank, n, dtype)
    every = np.stack([values(r, n, dtype) for r in range(world)])
    np_dtype = every.dtype

    def check(name, got, want):
        if not np.array_equal(np.asarray(as_np(got), dtype=np_dtype), want):
            wrong.append((name, as_np(got), want))

    for root in {0, world - 1}:
        t = tensor(mine, dtype)
        dist.broadcast(t, src=root)
        check(f"broadcast({root})", t, every[root])
        outs = [tensor(np.zeros(n, np_dtype), dtype) for _ in range(world)] if rank == root else None
        dist.gather(tensor(mine, dtype), outs, dst=root)
        if rank == root:
            check(f"gather({root})", np.stack([as_np(o) for o in outs]), every)
        out = tensor(np.zeros(n, np_dtype), dtype)
        pieces = [tensor(values(root, n, dtype, salt=q), dtype) for q in range(world)]
        dist.scatter(out, pieces if rank == root else None, src=root)
        check(f"scatter({root})", out, values(root, n, dtype, salt=rank))
    outs = [tensor(np.zeros(n, np_dtype), dtype) for _ in range(world)]
    dist.all_gather(outs, tensor(mine, dtype))
    check("all_gather", np.stack([as_np(o) for o in outs]), every)
    flat = tensor(np.zeros(world * n, np_dtype), dtype)
    dist.all_gather_into_tensor(flat, tensor(mine, dtype))
    check("all_gather_into_tensor", flat, every.reshape(-1))
    send = np.concatenate([values(rank, n, dtype, salt=100 * q) for q in range(world)])
    recv = tensor(np.zeros(world * n, np_dtype), dtype)
    dist.all_to_all_single(recv, tensor(send, dtype))
    check("all_to_all_single", recv, np.concatenate([values(r, n, dtype, salt=100 * rank) for r in range(world)]))
    dist.barrier()
    return wrong


@pytest.mark.parametrize("world", WORLDS)
def test_every_collective_dtype_and_op_through_shared_memory(world, monkeypatch):
    def body(rank, w):
        counter = ShmCounter()
        wrong = []
        for dtype in DTYPES:
            wrong += movements(rank, w, dtype, 5)
            wrong += reductions(rank, w, dtype, 5)
        win = dist.group.WORLD.shm.window
        win.settings = dataclasses.replace(win.settings, oneshot_bytes=0)  # reduce-scatter + all-gather ...
        monkeypatch.setattr(shm_algo, "WHOLE_CHUNKS_WORLD", 0)  # ... in groups of 2 as well
        dist.barrier()  # every rank is past its one-shot reductions before the plans go
        dist.group.WORLD.lane.forget_plans()  # the API's one-shot plans were made under the old sizes
        for dtype in DTYPES:
            wrong += reductions(rank, w, dtype, 5)
        return wrong, counter.ran()

    for rank, (wrong, syncs) in enumerate(run_threads(body, world)):
        assert not wrong, (rank, wrong[:3])
        assert syncs > 250


def _uneven_all_to_all(rank, world, scale):
    """Rank r sends (r + q) % 3 * scale + q elements to rank q."""
    send_rows = [(rank + q) % 3 * scale + q for q in range(world)]
    recv_rows = [(r + rank) % 3 * scale + rank for r in range(world)]
    inp = np.concatenate([np.full(c, rank * 1000 + q, np.int64) for q, c in enumerate(send_rows)])
    out = np.full(sum(recv_rows), -1, np.int64)
    dist.all_to_all_single(out, inp, output_split_sizes=recv_rows, input_split_sizes=send_rows)
    want = np.concatenate([np.full(c, r * 1000 + rank, np.int64) for r, c in enumerate(recv_rows)])
    outs = [np.full(c, -1, np.int64) for c in recv_rows]
    dist.all_to_all(outs, [np.full(c, rank * 1000 + q, np.int64) for q, c in enumerate(send_rows)])
    return np.array_equal(out, want) and np.array_equal(np.concatenate(outs), want)


def test_results_do_not_depend_on_the_number_of_helper_threads(monkeypatch):
    """Rounding-sensitive float32 sums over 8 ranks, 2 full chunks and a tail whose slices
    hold 2-3 elements: the split (chorus.shm.phases.Crew) must not change a single bit, also
    where a slice is too short to split."""
    n = 2 * (1 << 18) + 20  # 1 MiB slots: 262144 float32 per chunk

    def body(rank, w):
        rng = np.random.default_rng(rank)
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
        m = n // w
        y, out = x[: m * w].copy(), np.zeros(m, np.float32)
        dist.all_reduce(x)
        dist.reduce_scatter_tensor(out, y)
        return x.tobytes() + out.tobytes(), _handed()

    results = {}
    for threads in (1, 2, 4):
        with config.override(CHORUS_SHM_THREADS=threads, CHORUS_SHM_PART_BYTES=1024, CHORUS_SHM_COPY_CREW_BYTES=0):
            got = run_threads(body, 8)
        assert all(h > 0 for _, h in got) == (threads > 1)
        results[threads] = [b for b, _ in got]
    assert results[1] == results[2] == results[4]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_uneven_all_to_all_small_and_chunked(world, threads, monkeypatch):
    def body(rank, w):
        counter = ShmCounter()
        return [_uneven_all_to_all(rank, w, scale) for scale in (0, 1, 5, 3000)], counter.ran()

    with _crew(monkeypatch, threads, CHORUS_SHM_SLOT_BYTES=64 << 10):  # 8192 int64 per slot
        results = run_threads(body, world)
    for ok, syncs in results:
        assert all(ok), ok
        assert syncs >= 4


def test_all_to_all_mixing_one_count_ranks_with_table_ranks_ignores_stale_table_rows():
    """Op 0 (parity 0): every rank writes table rows.  Op 2 (parity 0 again): rank 0 sends
    and receives one count everywhere (one word; its parity-0 rows are op 0's, stale) while
    the others write rows."""
    def body(rank, w):
        def exchange(send, recv):
            inp = np.concatenate([np.full(c, 10 * rank + q, np.int64) for q, c in enumerate(send)])
            out = np.full(sum(recv), -1, np.int64)
            dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
            want = np.concatenate([np.full(c, 10 * r + rank, np.int64) for r, c in enumerate(recv)])
            return np.array_equal(out, want)

        table = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]  # op 0: table[r][q] from r to q
        ok = [exchange(table[rank], [table[r][rank] for r in range(w)])]
        x = np.ones(3)
        dist.all_reduce(x)  # op 1, parity 1
        table = [[2, 2, 2], [2, 1, 3], [2, 4, 5]]  # op 2: rank 0 sends and receives 2 everywhere
        ok.append(exchange(table[rank], [table[r][rank] for r in range(w)]))
        return ok

    assert run_threads(body, 3) == [[True, True]] * 3


def test_all_to_all_where_one_rank_is_uniform_and_others_need_more_rounds(monkeypatch):
    big = 10_000

    def counts(src, dst):
        return big if {src, dst} == {1, 2} else 5

    def body(rank, w):
        counter = ShmCounter()
        send = [counts(rank, q) for q in range(w)]
        recv = [counts(r, rank) for r in range(w)]
        inp = np.concatenate([np.full(c, 10 * rank + q, np.int64) for q, c in enumerate(send)])
        out = np.zeros(sum(recv), np.int64)
        dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
        want = np.concatenate([np.full(c, 10 * r + rank, np.int64) for r, c in enumerate(recv)])
        return np.array_equal(out, want), counter.ran()

    with config.override(CHORUS_SHM_SLOT_BYTES=64 << 10):  # 2730 int64 per piece at W=3
        results = run_threads(body, 3)
    assert results == [(True, 4)] * 3  # ceil(10000 / 2730) = 4 rounds on every rank


def _crew(monkeypatch, threads, **settings):
    """The settings (a ``config.override``) for ``threads`` per rank (chorus.shm.phases.Crew),
    splitting phases from 1 KiB (rows of 256 B) of messages of any size, and ``settings``."""
    monkeypatch.setattr(shm_phases, "PART_ROW_BYTES", 256)
    return config.override(CHORUS_SHM_THREADS=threads, CHORUS_SHM_PART_BYTES=1024, CHORUS_SHM_COPY_CREW_BYTES=0,
                           **settings)


def _handed():
    """Tasks this rank's default group handed to helper threads so far."""
    team = dist.api.state.current().default_group.shm.window.crew
    return 0 if team is None else team.handed


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_sizes_across_the_one_shot_threshold_and_the_slot(world, threads, monkeypatch):
    cap = 16384  # float32 per slot

    def body(rank, w):
        counter = ShmCounter()
        bad = []
        edge = 4096 // (4 * max(1, w - 1))  # the largest one-shot all_reduce (W > 2)
        for n in (0, 1, edge - 1, edge, edge + 1, cap - 1, cap, cap + 1, 3 * cap + 7):
            rows = np.stack([np.arange(n, dtype=np.float32) % 97 + r for r in range(w)])
            x = rows[rank].copy()
            dist.all_reduce(x)
            if not np.array_equal(x, rows.sum(axis=0)):
                bad.append(("all_reduce", n))
            x = rows[rank].copy()
            dist.reduce(x, dst=w - 1, op=dist.ReduceOp.MAX)
            if not np.array_equal(x, rows.max(axis=0) if rank == w - 1 else rows[rank]):
                bad.append(("reduce", n))
            x = rows[rank].copy() if rank == 0 else np.zeros(n, np.float32)
            dist.broadcast(x, src=0)
            bad += [("broadcast", n)] * (not np.array_equal(x, rows[0]))
            out = np.zeros(w * n, np.float32)
            dist.all_gather_into_tensor(out, rows[rank])
            bad += [("all_gather", n)] * (not np.array_equal(out, rows.reshape(-1)))
            out = np.zeros(n, np.float32)
            dist.scatter(out, list(rows) if rank == 1 % w else None, src=1 % w)
            bad += [("scatter", n)] * (not np.array_equal(out, rows[rank]))
            big = np.concatenate([rows[rank] * (q + 1) for q in range(w)])
            out = np.zeros(n, np.float32)
            dist.reduce_scatter_tensor(out, big)
            bad += [("reduce_scatter", n)] * (not np.array_equal(out, rows.sum(axis=0) * (rank + 1)))
            out = np.zeros(w * n, np.float32)
            dist.all_to_all_single(out, big)
            want = np.concatenate([rows[r] * (rank + 1) for r in range(w)])
            bad += [("all_to_all", n)] * (not np.array_equal(out, want))
        return bad, counter.ran(), _handed()

    with _crew(monkeypatch, threads, CHORUS_SHM_SLOT_BYTES=cap * 4, CHORUS_SHM_ONESHOT_BYTES=4096):
        results = run_threads(body, world)
    for bad, syncs, handed in results:
        assert not bad, bad
        assert syncs > 60
        assert (handed > 100) == (threads > 1), handed


def test_async_ops_keep_issue_order_and_results():
    def body(rank, w):
        counter = ShmCounter()
        xs = [np.full(100 * (i + 1), rank + i, np.int64) for i in range(12)]
        works = [dist.all_reduce(x, async_op=True) for x in xs]
        y = np.full(3, rank, np.int64)
        dist.all_reduce(y)  # synchronous, queued behind the async ones
        outs = [np.zeros(4, np.int64) for _ in range(w)]
        gw = dist.all_gather(outs, np.full(4, rank, np.int64), async_op=True)
        assert gw.wait() and gw.is_completed() and gw.is_success()
        for work in works:
            work.wait()
        fut = dist.all_reduce(np.ones(2), async_op=True).get_future()
        total = fut.wait()[0]
        return ([int(x[0]) for x in xs], int(y[0]), [int(o[0]) for o in outs], total.tolist(),
                counter.ran())

    w = 4
    for xs, y, gathered, total, syncs in run_threads(body, w):
        assert xs == [sum(r + i for r in range(w)) for i in range(12)]
        assert y == sum(range(w)) and gathered == list(range(w)) and total == [w, w]
        assert syncs >= 15


def test_sub_groups_get_their_own_window():
    def body(rank, w):
        evens = dist.new_group([0, 2])
        odds = dist.new_group([1, 3])
        mine = evens if rank % 2 == 0 else odds
        counter = ShmCounter(mine)
        x = np.full(3, rank, np.int64)
        dist.all_reduce(x, group=mine)
        other = odds if rank % 2 == 0 else evens
        dist.all_reduce(np.zeros(1), group=other)  # not a member: does nothing
        world_x = np.full(1, rank, np.int64)
        dist.all_reduce(world_x)
        return int(x[0]), counter.ran(), mine.shm is not dist.group.WORLD.shm, int(world_x[0])

    results = run_threads(body, 4)
    assert [r[0] for r in results] == [2, 4, 2, 4]
    assert all(r[1] == 1 and r[2] and r[3] == 6 for r in results)


def test_forced_tcp_algorithm_bypasses_shared_memory():
    def body(rank, w):
        counter = ShmCounter()
        x = np.full(4, rank, np.int64)
        dist.all_reduce(x, algorithm="ring")
        return int(x[0]), counter.ran()

    assert run_threads(body, 3) == [(3, 0)] * 3


def test_small_all_reduce_takes_the_cached_one_shot_plan_and_matches_the_general_path(monkeypatch):
    from chorus.shm.group import ShmGroup

    calls = []
    plain = ShmGroup.all_reduce_planned
    monkeypatch.setattr(ShmGroup, "all_reduce_planned",
                        lambda self, *a: (calls.append(self.group), plain(self, *a))[1])
    cases = [("float32", "SUM"), ("int64", "MAX"), ("float64", "AVG"), ("bool", "BXOR"),
             ("float32", "PRODUCT"), ("int32", "BAND")]

    def body(rank, w):
        same = []
        for dtype, op in cases:
            x = values(rank, 37, dtype, op)
            fast, general = x.reshape(1, 37).copy(), x.copy()
            dist.all_reduce(fast, op=getattr(dist.ReduceOp, op))  # the plan (2-D is fine)
            dist.all_reduce(general, op=getattr(dist.ReduceOp, op), async_op=True).wait()  # general
            expected = reference(np.stack([values(r, 37, dtype, op) for r in range(w)]), op, w)
            same.append(np.array_equal(fast[0], general) and np.allclose(general, expected))
        strided = (np.arange(24, dtype=np.float32).reshape(4, 6) + rank)[:, ::2]  # not contiguous
        dist.all_reduce(strided)
        read_only = np.ones(3)
        read_only.flags.writeable = False
        with pytest.raises(dist.InvalidArgumentError, match="read-only"):
            dist.all_reduce(read_only)
        with pytest.raises(dist.InvalidArgumentError, match="BAND is not defined for float32"):
            dist.all_reduce(np.ones(2, np.float32), op=dist.ReduceOp.BAND)
        return same, strided

    for same, strided in run_threads(body, 3):
        assert all(same)
        assert np.array_equal(strided, 3 * np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2] + 3)
    assert len(calls) == 3 * len(cases)  # the fast ones only: not async, strided, read-only or invalid


def test_the_latency_paths_last_plan_follows_the_op_the_dtype_and_the_shape():
    """Repeated calls reuse the last plan only for the same dtype, op and shape."""
    def body(rank, w):
        x, got = np.full(5, rank + 1, np.int64), []
        for op in ("SUM", "MAX", "MAX", "SUM", "MIN"):
            y = x.copy()
            dist.all_reduce(y, op=getattr(dist.ReduceOp, op))
            got.append(y.tolist())
        for y in (x.astype(np.float64), x.astype(np.int32), x.reshape(5, 1).copy(), x[:3].copy()):
            dist.all_reduce(y)
            got.append((y.dtype.name, y.shape, y.ravel().tolist()))
        return got

    for got in run_threads(body, 3):
        assert got[:5] == [[6] * 5, [3] * 5, [3] * 5, [6] * 5, [1] * 5]
        assert got[5:] == [("float64", (5,), [6.0] * 5), ("int32", (5,), [6] * 5),
                           ("int64", (5, 1), [6] * 5), ("int64", (3,), [6] * 3)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_one_shot_plan_handles_0d_and_nd_arrays(world):
    def body(rank, w):
        scalar = np.array(rank + 1.0)  # FSDP2 averages a 0-d loss like this
        dist.all_reduce(scalar, op=dist.ReduceOp.AVG)
        cube = np.full((2, 3, 4), rank, np.int64)
        dist.all_reduce(cube, op=dist.ReduceOp.MAX)
        return float(scalar), cube

    for scalar, cube in run_threads(body, world):
        assert scalar == (world + 1) / 2 and np.array_equal(cube, np.full((2, 3, 4), world - 1))


@pytest.mark.parametrize("dtype, op", [("float32", "SUM"), ("float64", "PRODUCT"), ("float32", "PRODUCT"),
                                       ("int32", "MAX"), ("float16", "MIN"), ("bool", "BXOR"), ("bfloat16", "SUM")])
@pytest.mark.parametrize("n", [1, 3, 100, 40000])
def test_two_rows_reduce_into_either_row_with_the_same_bits(dtype, op, n):
    """Single copy in groups of 2 passes this rank's own row as one of the two rows and as
    ``out``: the same bits as reducing the rows stacked into another array.  (Not for
    complex dtypes: numpy's in-place complex multiply of short arrays differs.)"""
    from chorus.reductions import float32_to_bf16, row_reducer

    rng = np.random.default_rng(n)
    floats = [rng.standard_normal(n).astype(np.float32) * 10 for _ in range(2)]
    rows = [float32_to_bf16(f) if dtype == "bfloat16" else f > 0 if dtype == "bool" else f.astype(dtype)
            for f in floats]
    reduce = row_reducer(op, dtype)
    expected = np.empty_like(rows[0])
    reduce(np.stack(rows), expected)
    for mine in range(2):
        given = [row.copy() for row in rows]
        reduce(given, given[mine])
        assert given[mine].tobytes() == expected.tobytes(), mine
        assert given[1 - mine].tobytes() == rows[1 - mine].tobytes()


@pytest.mark.parametrize("call", [
    lambda group=None: dist.all_reduce(np.ones(4, np.float32), group=group),
    lambda group=None: dist.all_to_all_single(np.zeros(4, np.float32), np.ones(4, np.float32), group=group),
], ids=["all_reduce", "all_to_all_single"])
def test_the_latency_path_raises_what_the_general_path_raises(call):
    """A thread outside the job (no world of its own) and a destroyed group get the general
    path's errors, also right after the same call succeeded on the latency path."""
    import threading

    def body(rank, w):
        pg, sub = dist.group.WORLD, dist.new_group([0, 1])
        call()
        call(group=sub)  # both groups hold a plan for this call now
        errors = []

        def outsider():
            try:
                call(group=pg)
            except Exception as exc:  # noqa: BLE001 - the error is the result
                errors.append(type(exc).__name__)
        t = threading.Thread(target=outsider)
        t.start()
        t.join()
        dist.destroy_process_group(sub)
        with pytest.raises(dist.AbortedError, match="destroyed"):
            call(group=sub)
        return errors

    assert run_threads(body, 2) == [["NotInitializedError"]] * 2
