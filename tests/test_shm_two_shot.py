"""The latency path of all_reduce beyond one-shot: reduce-scatter + all-gather in one
chunk of the window (chorus.shm.collectives.two_shot) from a cached plan
(chorus.shm.group.Planned with a ``part``).  It must give the general path's bits on every
rank, keep the window's parities in step with the general path, and raise what the general
path raises when ranks call different ops."""

import numpy as np
import pytest

import chorus as dist
from chorus import config
from chorus.shm.group import ShmGroup
from chorus.testing import run_threads

CASES = [("float32", "SUM"), ("float64", "AVG"), ("int64", "MAX"), ("bool", "BXOR"), ("float16", "PRODUCT")]


def _inputs(rank: int, n: int, dtype: str, op: str) -> np.ndarray:
    """Values whose float sums depend on the order of the additions."""
    rng = np.random.default_rng(1000 * rank + n)
    if dtype == "bool":
        return rng.random(n) < 0.5
    if op == "PRODUCT":
        return (1 + rng.random(n) / 8).astype(dtype)
    if dtype.startswith("int"):
        return rng.integers(-1000, 1000, n).astype(dtype)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)


def _count_lanes(monkeypatch) -> list:
    """Record, per call of the latency path, whether it ran the two-shot plan."""
    seen = []
    plain = ShmGroup.all_reduce_planned
    monkeypatch.setattr(ShmGroup, "all_reduce_planned",
                        lambda self, pg, seq, plan, data: (seen.append(plan.part is not None),
                                                           plain(self, pg, seq, plan, data))[1])
    return seen


@pytest.mark.parametrize("world", [3, 8])
def test_two_shot_plan_gives_the_general_paths_bits_on_every_rank(world, monkeypatch):
    seen = _count_lanes(monkeypatch)

    def body(rank, w):
        out = []
        for dtype, op in CASES:
            for n in (1000, w - 1, 4099):  # a slice per rank, some ranks with none, uneven slices
                x = _inputs(rank, n, dtype, op)
                lane, general, again = x.copy(), x.copy(), x.reshape(1, n).copy()
                red = getattr(dist.ReduceOp, op)
                dist.all_reduce(lane, op=red)
                dist.all_reduce(general, op=red, async_op=True).wait()  # the general path
                dist.all_reduce(again, op=red)  # the plan again, at the other parity
                out.append((dtype, op, n, lane.tobytes(), general.tobytes(), again.tobytes()))
        return out

    with config.override(CHORUS_SHM_ONESHOT_BYTES=0):
        results = run_threads(body, world)
    for rank_out in results:
        assert rank_out == results[0]  # every rank holds the same bytes
        for dtype, op, n, lane, general, again in rank_out:
            assert lane == general == again, (dtype, op, n)
    rows_of = {(dtype, op, n): np.stack([_inputs(r, n, dtype, op) for r in range(world)])
               for dtype, op in CASES for n in (1000, world - 1, 4099)}
    for dtype, op, n, lane, _, _ in results[0]:
        got = np.frombuffer(lane, dtype=rows_of[(dtype, op, n)].dtype)
        rows = rows_of[(dtype, op, n)]
        want = {"SUM": rows.sum(0), "AVG": rows.sum(0) / world, "MAX": rows.max(0),
                "BXOR": np.logical_xor.reduce(rows, 0), "PRODUCT": rows.prod(0)}[op]
        assert np.allclose(got, want, rtol=1e-2 if dtype == "float16" else 1e-6), (dtype, op, n)
    assert seen.count(True) == world * 2 * len(CASES) * 3  # two of the three calls of each case


def test_one_shot_and_two_shot_plans_alternate_without_losing_step(monkeypatch):
    """Sizes on either side of CHORUS_SHM_ONESHOT_BYTES, interleaved with other collectives."""
    seen = _count_lanes(monkeypatch)

    def body(rank, w):
        bad = []
        for i in range(30):
            n = 16 + i % 3 if i % 2 == 0 else 5000 + i  # one-shot up to 42 int64 at W = 4
            x = np.arange(n, dtype=np.int64) * (rank + 1) + i
            dist.all_reduce(x)
            if not np.array_equal(x, (np.arange(n, dtype=np.int64) * (w * (w + 1) // 2)) + w * i):
                bad.append(n)
            if i % 7 == 3:
                y = np.full(3, rank, np.int64)
                dist.broadcast(y, src=i % w)
                bad += [("broadcast", i)] * (not np.array_equal(y, np.full(3, i % w)))
        return bad

    with config.override(CHORUS_SHM_ONESHOT_BYTES=1024):
        assert run_threads(body, 4) == [[]] * 4
    assert seen.count(True) == 4 * 15 and seen.count(False) == 4 * 15


def test_ranks_calling_different_counts_on_the_two_shot_path_get_a_mismatch():
    def body(rank, w):
        x = np.ones(3000 + (rank == 1), np.float32)
        with pytest.raises(dist.CollectiveMismatchError, match="count=3001"):
            dist.all_reduce(x)
        return True

    with config.override(CHORUS_SHM_ONESHOT_BYTES=0):
        assert run_threads(body, 3) == [True] * 3
