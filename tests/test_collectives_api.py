"""The collective API on ranks as threads: every algorithm forced with ``algorithm=``
(every reduce op and dtype family for all_reduce's, every root for broadcast's) against
numpy, on 1, 2, 3 and 5 ranks; torch tensors; async ops; sub-groups; bad input; the
environment's algorithm choice.  Each collective's default path on every component is
tests/test_collectives_grid.py's."""

import numpy as np
import pytest
from torch_support import needs_torch, torch

import chorus as dist
from chorus.schedules.registry import ALGORITHMS
from chorus.testing import RankFailed, run_threads

WORLDS = [1, 2, 3, 5]
INT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
FLOAT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]


def _input(rank, n, dtype, salt=0):
    rng = np.random.default_rng(1000 * rank + 7 * n + salt)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if dtype.startswith("complex"):
        return (rng.integers(-3, 4, n) + 1j * rng.integers(-3, 4, n)).astype(dtype)
    if dtype.startswith("float"):
        return rng.integers(-8, 9, n).astype(dtype)  # small integers: exact in any order
    return rng.integers(1, 6, n).astype(dtype)


def _reference(op, arrays):
    fn = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
          "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor, "AVG": np.add}[op]
    if arrays[0].dtype == bool:
        fn = {"SUM": np.logical_or, "PRODUCT": np.logical_and, "MIN": np.logical_and,
              "MAX": np.logical_or, "BAND": np.logical_and, "BOR": np.logical_or, "BXOR": np.logical_xor}[op]
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = fn(out, a)
    return out / len(arrays) if op == "AVG" else out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype,ops", [("int64", INT_OPS), ("uint8", ["SUM", "MAX", "BXOR"]),
                                       ("float32", FLOAT_OPS), ("float64", ["SUM", "MIN"]),
                                       ("float16", ["SUM", "MAX"]), ("bool", ["SUM", "PRODUCT", "BXOR"]),
                                       ("complex64", ["SUM", "PRODUCT", "AVG"])])
def test_every_all_reduce_algorithm_every_op(world, dtype, ops):
    n = 37

    def body(rank, w):
        out = {}
        for op in ops:
            for algo in ALGORITHMS["all_reduce"]:
                x = _input(rank, n, dtype)
                dist.all_reduce(x, op=getattr(dist.ReduceOp, op), algorithm=algo)
                out[(op, algo)] = x
        return out

    results = run_threads(body, world)
    for op in ops:
        expect = _reference(op, [_input(r, n, dtype) for r in range(world)]).astype(dtype)
        for rank, res in enumerate(results):
            for algo in ALGORITHMS["all_reduce"]:
                np.testing.assert_array_equal(res[(op, algo)], expect, err_msg=f"{op} {algo} r{rank}")


@pytest.mark.parametrize("world", WORLDS)
def test_every_rooted_and_gathering_algorithm_every_root(world):
    n = 5

    def body(rank, w):
        out = {}
        for root in range(w):
            for algo in ALGORITHMS["broadcast"]:
                x = _input(rank, n, "int32", salt=root)
                dist.broadcast(x, src=root, algorithm=algo)
                out[("broadcast", root, algo)] = x
            for algo in ALGORITHMS["reduce"]:
                x = _input(rank, n, "int32", salt=root)
                dist.reduce(x, dst=root, op=dist.ReduceOp.MAX, algorithm=algo)
                out[("reduce", root, algo)] = x
            lst = [np.zeros(n, np.int32) for _ in range(w)] if rank == root else None
            dist.gather(_input(rank, n, "int32"), gather_list=lst, dst=root, algorithm="binomial")
            out[("gather", root)] = lst
            y = np.zeros(n, np.int32)
            parts = [_input(i, n, "int32", salt=99) for i in range(w)] if rank == root else None
            dist.scatter(y, parts, src=root, algorithm="binomial")
            out[("scatter", root)] = y
        for algo in ALGORITHMS["all_gather"]:
            lst = [np.zeros(n, np.int32) for _ in range(w)]
            dist.all_gather(lst, _input(rank, n, "int32"), algorithm=algo)
            out[("all_gather", algo)] = lst
        return out

    results = run_threads(body, world)
    blocks = [_input(r, n, "int32") for r in range(world)]
    for rank, res in enumerate(results):
        for root in range(world):
            for algo in ALGORITHMS["broadcast"]:
                np.testing.assert_array_equal(res[("broadcast", root, algo)], _input(root, n, "int32", salt=root))
            maxed = np.max([_input(r, n, "int32", salt=root) for r in range(world)], axis=0)
            for algo in ALGORITHMS["reduce"]:
                np.testing.assert_array_equal(res[("reduce", root, algo)],
                                              maxed if rank == root else _input(rank, n, "int32", salt=root))
            if rank == root:
                np.testing.assert_array_equal(np.stack(res[("gather", root)]), np.stack(blocks))
            np.testing.assert_array_equal(res[("scatter", root)], _input(rank, n, "int32", salt=99))
        for algo in ALGORITHMS["all_gather"]:
            np.testing.assert_array_equal(np.stack(res[("all_gather", algo)]), np.stack(blocks))


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_scatter_and_all_to_all(world):
    def body(rank, w):
        out = {}
        for algo in ALGORITHMS["reduce_scatter"]:
            inp = _input(rank, 4 * w, "int64")
            o = np.zeros(4, np.int64)
            dist.reduce_scatter_tensor(o, inp, algorithm=algo)
            out[("rst", algo)] = o
        uneven = [np.full(i + 1, rank + 10 * i, np.int64) for i in range(w)]
        for algo in ALGORITHMS["reduce_scatter"]:
            o = np.zeros(rank + 1, np.int64)
            dist.reduce_scatter(o, uneven, algorithm=algo)
            out[("rs_uneven", algo)] = o
        for algo in ALGORITHMS["all_to_all"]:
            ins = [np.full(3, 100 * rank + j, np.int64) for j in range(w)]
            outs = [np.zeros(3, np.int64) for _ in range(w)]
            dist.all_to_all(outs, ins, algorithm=algo)
            out[("a2a", algo)] = outs
        # uneven all_to_all_single: rank r sends j+1 rows to rank j, each row [r, j]
        splits_in = [j + 1 for j in range(w)]
        inp = np.concatenate([np.tile([rank, j], (j + 1, 1)) for j in range(w)]).astype(np.int32)
        o = np.zeros((w * (rank + 1), 2), np.int32)
        dist.all_to_all_single(o, inp, output_split_sizes=[rank + 1] * w, input_split_sizes=splits_in)
        out["a2as"] = o
        return out

    results = run_threads(body, world)
    for rank, res in enumerate(results):
        total = sum(_input(r, 4 * world, "int64") for r in range(world))
        for algo in ALGORITHMS["reduce_scatter"]:
            np.testing.assert_array_equal(res[("rst", algo)], total[4 * rank: 4 * rank + 4])
        for algo in ALGORITHMS["reduce_scatter"]:
            np.testing.assert_array_equal(res[("rs_uneven", algo)],
                                          np.full(rank + 1, sum(range(world)) + 10 * rank * world))
        for algo in ALGORITHMS["all_to_all"]:
            np.testing.assert_array_equal(np.stack(res[("a2a", algo)])[:, 0], [100 * j + rank for j in range(world)])
        expect = np.concatenate([np.tile([j, rank], (rank + 1, 1)) for j in range(world)])
        np.testing.assert_array_equal(res["a2as"], expect)


@needs_torch
def test_torch_tensors_bfloat16_non_contiguous_and_premul():
    def body(rank, w):
        t = torch.full((4,), float(rank + 1), dtype=torch.bfloat16)
        dist.all_reduce(t)
        m = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        p = torch.ones(3) * (rank + 1)
        dist.all_reduce(p, op=dist._make_nccl_premul_sum(0.5))
        a = torch.full((2,), float(rank), dtype=torch.float16)
        dist.all_reduce(a, op=dist.ReduceOp.AVG)
        return t, m, p, a

    for t, m, p, a in run_threads(body, 3):
        assert t.dtype == torch.bfloat16 and t.tolist() == [6.0] * 4
        assert torch.equal(m, torch.arange(12, dtype=torch.float32).reshape(3, 4).t())
        assert p.tolist() == [3.0] * 3  # 0.5 * (1 + 2 + 3)
        assert a.tolist() == [1.0, 1.0]


def test_async_ops_complete_in_order_with_results():
    def body(rank, w):
        xs = [np.full(3, rank + i, np.int64) for i in range(4)]
        works = [dist.all_reduce(x, async_op=True) for x in xs]
        works.append(dist.broadcast(b := np.full(2, rank), src=1, async_op=True))
        dist.barrier()
        assert all(wk.is_completed() and wk.is_success() for wk in works)
        assert works[0].result()[0] is xs[0]
        fut = works[1].get_future()
        assert fut.wait()[0] is xs[1]
        return [int(x[0]) for x in xs], b.tolist()

    world = 4
    for sums, b in run_threads(body, world):
        assert sums == [sum(range(world)) + i * world for i in range(4)] and b == [1, 1]


def test_sub_groups_and_non_members():
    def body(rank, w):
        g = dist.new_group([1, 2, 3])
        x = np.array([rank], np.int64)
        r = dist.all_reduce(x, group=g)
        assert r is None
        y = np.array([rank], np.int64)
        dist.broadcast(y, src=3, group=g)  # src is a global rank
        z = np.array([rank], np.int64)
        dist.broadcast(z, group_src=0, group=g) if rank else None
        return int(x[0]), int(y[0]), int(z[0])

    assert run_threads(body, 4) == [(0, 0, 0), (6, 3, 1), (6, 3, 1), (6, 3, 1)]


def _expect(body, world, exc_type, match):
    with pytest.raises(RankFailed) as info:
        run_threads(body, world)
    errs = info.value.errors
    first = errs[min(errs)]
    assert isinstance(first, exc_type), repr(first)
    assert match in str(first), str(first)
    return errs


@pytest.mark.parametrize("call,exc,match", [
    (lambda: dist.all_reduce(np.ones(2), op=dist.ReduceOp.BAND), ValueError, "BAND is not defined for float64"),
    (lambda: dist.all_reduce(np.ones(2, np.complex64), op=dist.ReduceOp.MAX), ValueError, "MAX is not defined"),
    (lambda: dist.all_reduce(np.ones(2, np.int32), op=dist.ReduceOp.AVG), ValueError, "AVG is not defined"),
    (lambda: dist.all_reduce(np.ones(2), op=dist.ReduceOp.PREMUL_SUM), ValueError, "needs a factor"),
    (lambda: dist.all_reduce(np.ones(2), op="sum"), ValueError, "ReduceOp member"),
    (lambda: dist.all_reduce([1.0]), TypeError, "numpy.ndarray or a torch.Tensor"),
    (lambda: dist.all_gather([np.zeros(2)], np.zeros(2)), ValueError, "list of 2 tensors"),
    (lambda: dist.all_gather([np.zeros(2), np.zeros(3)], np.zeros(2)), ValueError, "same number of elements"),
    (lambda: dist.all_gather_into_tensor(np.zeros(3), np.zeros(2)), ValueError, "needs world_size (2) x 2"),
    (lambda: dist.broadcast(np.zeros(2), src=7), ValueError, "not a member"),
    (lambda: dist.all_reduce(np.zeros(2), algorithm="nope"), ValueError, "unknown algorithm 'nope'"),
    (lambda: dist.all_to_all_single(np.zeros(3), np.zeros(3)), ValueError, "not divisible by world_size"),
    (lambda: dist.reduce_scatter_tensor(np.zeros(2), np.zeros(3)), ValueError, "needs world_size"),
])
def test_bad_input_raises_before_sending(call, exc, match):
    def body(rank, w):
        call()

    _expect(body, 2, exc, match)


def test_env_selects_algorithm_and_rejects_unknown(monkeypatch):
    monkeypatch.setenv("CHORUS_ALGO_ALL_REDUCE", "ring")

    def body(rank, w):
        x = np.full(10, rank, np.int64)
        dist.all_reduce(x)
        return int(x[0])

    assert run_threads(body, 3) == [3, 3, 3]
    monkeypatch.setenv("CHORUS_ALGO_ALL_REDUCE", "bogus")
    _expect(body, 2, ValueError, "CHORUS_ALGO_ALL_REDUCE")


def test_an_overflowing_reduction_gives_inf_without_a_warning():
    """IEEE results, silently, as gloo and NCCL give them (on every path: the latency
    lane, the general window path, TCP schedules), under Python's default warning filters."""
    import warnings

    def body(rank, w):
        small, large = np.full(4, 3e38, np.float32), np.full(300_000, 3e38, np.float32)
        dist.all_reduce(small)
        dist.all_reduce(large)
        tcp = np.full(4, 3e38, np.float32)
        dist.all_reduce(tcp, algorithm="ring")
        return bool(np.isinf(small).all() and np.isinf(large).all() and np.isinf(tcp).all())

    with warnings.catch_warnings(record=True) as seen:  # the filters in force, chorus's included
        assert run_threads(body, 2) == [True, True]
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in seen]
