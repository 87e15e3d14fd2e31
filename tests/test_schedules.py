"""Every algorithm of the registry through the simulator, against numpy's answer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chorus.schedules import ALGORITHMS, Copy, Recv, Region, Schedule, Send, chunks, schedule
from chorus.sim import ROOTED, ScheduleError, check, execute, simulate

FAST = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
WORLDS = list(range(1, 17)) + [17, 31, 32, 64]
OPS = ["sum", "prod", "min", "max", "band", "bor", "bxor"]
SEGMENTED = ("all_reduce", "broadcast")
PAIRS = [(c, a) for c, family in ALGORITHMS.items() for a in family]
# Elements each rank holds, at most: keeps W = 64 with output buffers of W blocks fast.
BUDGET = 2000


def _count(world: int, which: int, blocks: int) -> int:
    """count in {0, 1, W-1, W+1, an odd size near 1000003 / W}, capped for speed."""
    big = min(1000003 // world, BUDGET // blocks) | 1
    return [0, 1, world - 1, world + 1, big][which]


def _blocks(collective: str, world: int) -> int:
    return world if collective in ("all_gather", "gather", "scatter", "all_to_all") else 1


@pytest.mark.parametrize("collective,algorithm", PAIRS)
@FAST
@given(data=st.data())
def test_matches_reference(collective, algorithm, data):
    world = data.draw(st.sampled_from(WORLDS), "world")
    count = _count(world, data.draw(st.integers(0, 4), "count"), _blocks(collective, world))
    root = data.draw(st.integers(0, world - 1), "root")
    op = data.draw(st.sampled_from(OPS), "op")
    kwargs = {}
    if collective in SEGMENTED:
        segment = data.draw(st.sampled_from([0, 1, 3, 64]), "segment")
        kwargs["segment"] = segment and max(segment, count // 100)  # <= ~100 pieces
    dtype = np.uint8 if op in ("band", "bor") else np.int64
    check(collective, algorithm, world, count, root=root, op=op, dtype=dtype, **kwargs)


@pytest.mark.parametrize("collective,algorithm", PAIRS)
def test_every_world(collective, algorithm):
    for world in WORLDS:
        check(collective, algorithm, world, _count(world, world % 5, _blocks(collective, world)),
              root=world // 3, op=OPS[world % len(OPS)], seed=world)


@pytest.mark.parametrize("collective,algorithm",
                         [(c, a) for c, a in PAIRS if c in ROOTED])
@pytest.mark.parametrize("world", range(1, 10))
def test_every_root(collective, algorithm, world):
    for root in range(world):
        check(collective, algorithm, world, 3, root=root, op="max",
              **({"segment": 2} if collective in SEGMENTED else {}))


@pytest.mark.parametrize("collective,algorithm", PAIRS)
@pytest.mark.parametrize("world", [1, 3])
def test_empty_and_single_rank(collective, algorithm, world):
    check(collective, algorithm, world, 0)
    check(collective, algorithm, world, 1, op="prod")


@pytest.mark.parametrize("algorithm", ["ring", "pairwise"])
@FAST
@given(world=st.sampled_from(WORLDS[:12]), data=st.data())
def test_reduce_scatter_uneven(algorithm, world, data):
    counts = data.draw(st.lists(st.integers(0, 9), min_size=world, max_size=world))
    check("reduce_scatter", algorithm, world, tuple(counts), op="bxor")


@FAST
@given(world=st.sampled_from(WORLDS[:12]), data=st.data())
def test_pairwise_all_to_all_uneven(world, data):
    row = st.lists(st.integers(0, 6), min_size=world, max_size=world)
    matrix = data.draw(st.lists(row, min_size=world, max_size=world))
    check("all_to_all", "pairwise", world, matrix)


def test_bruck_all_to_all_refuses_uneven_blocks():
    with pytest.raises(ValueError, match="pairwise"):
        schedule("all_to_all", "bruck", 0, 2, send_counts=(1, 2), recv_counts=(1, 3))


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS["all_reduce"]))
@pytest.mark.parametrize("world", [3, 5, 6, 8, 13])
def test_all_reduce_bit_identical_floats(algorithm, world):
    out = check("all_reduce", algorithm, world, 1001, dtype=np.float64, segment=50)
    for rank in out:
        assert rank["data"].tobytes() == out[0]["data"].tobytes()


def test_inputs_unchanged_and_no_output_on_non_roots():
    world, rng = 5, np.random.default_rng(3)
    x = [rng.integers(-9, 9, 6) for _ in range(world)]
    out = simulate("reduce", "binomial", world, [{"data": a} for a in x], root=2)
    assert all(np.array_equal(out[r]["data"], x[r]) for r in range(world) if r != 2)
    out = simulate("gather", "binomial", world, [{"input": a} for a in x], root=1)
    assert ["output" in o for o in out] == [r == 1 for r in range(world)]
    for collective in ("all_gather", "reduce_scatter"):
        for algorithm in ALGORITHMS[collective]:
            out = simulate(collective, algorithm, world, [{"input": a} for a in x])
            assert all(np.array_equal(o["input"], a) for o, a in zip(out, x, strict=True))
    inputs = [{"input": np.arange(10)} if r == 4 else {} for r in range(world)]
    out = simulate("scatter", "binomial", world, inputs, root=4)
    assert [list(o["output"]) for o in out] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_schedules_use_only_their_buffers_and_nonnegative_tags():
    allowed = {"all_reduce": {"data", "scratch"}, "broadcast": {"data"},
               "reduce": {"data", "scratch"}, "barrier": {"token"}}
    for collective, algorithm in PAIRS:
        kwargs = _kwargs(collective, 7, 5)
        for rank in range(7):
            for step in schedule(collective, algorithm, rank, 7, **kwargs):
                for op in step:
                    regions = [op.src, op.dst] if isinstance(op, Copy) else \
                        [op.src if isinstance(op, Send) else op.dst]
                    names = {r.buffer for r in regions}
                    assert names <= allowed.get(collective, {"input", "output", "scratch"})
                    assert isinstance(op, Copy) or op.tag >= 0


def _kwargs(collective: str, world: int, count: int) -> dict:
    if collective == "reduce_scatter":
        return {"counts": (count,) * world}
    if collective == "all_to_all":
        return {"send_counts": (count,) * world, "recv_counts": (count,) * world}
    if collective == "barrier":
        return {}
    return {"count": count, **({"root": 2} if collective in ROOTED else {})}


def test_registry_errors_list_the_valid_names():
    with pytest.raises(ValueError, match="recursive_doubling"):
        schedule("all_reduce", "tree", 0, 4, count=4)
    with pytest.raises(ValueError, match="all_to_all"):
        schedule("allreduce", "ring", 0, 4, count=4)
    assert {c: sorted(f) for c, f in ALGORITHMS.items()} == {
        "all_reduce": ["rabenseifner", "recursive_doubling", "ring", "two_shot"],
        "broadcast": ["binomial", "chain"], "reduce": ["binomial"],
        "all_gather": ["bruck", "ring"], "gather": ["binomial"], "scatter": ["binomial"],
        "reduce_scatter": ["pairwise", "ring"], "all_to_all": ["bruck", "linear", "pairwise"],
        "barrier": ["dissemination"]}


@pytest.mark.parametrize("call,match", [
    (lambda: schedule("all_reduce", "ring", 4, 4, count=1), "rank 4"),
    (lambda: schedule("broadcast", "binomial", 0, 4, count=1, root=-1), "root -1"),
    (lambda: schedule("gather", "binomial", 0, 0, count=1, root=0), "world size"),
    (lambda: schedule("all_gather", "ring", 0, 2, count=-1), "counts must be >= 0"),
    (lambda: schedule("reduce_scatter", "ring", 0, 3, counts=(1, 2)), "one count per rank"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -- the simulator catches broken schedules ---------------------------------------------


def _run(*per_rank: tuple, size: int = 8, scratch: int = 0) -> list[dict]:
    bufs = [{"data": np.arange(size) + 10 * r, "scratch": np.zeros(scratch, np.int64)}
            for r in range(len(per_rank))]
    execute([Schedule(tuple(steps)) for steps in per_rank], bufs)
    return bufs


D = Region("data", 0, 4)


def test_fifo_and_eager_sends():
    first, second = Region("data", 0, 2), Region("data", 2, 2)
    bufs = _run([(Send(1, first, 7),), (Send(1, second, 7),)],
                [(Recv(0, Region("data", 4, 2), 7), Recv(0, Region("data", 6, 2), 7))])
    assert list(bufs[1]["data"][4:]) == [0, 1, 2, 3]


@pytest.mark.parametrize("steps,match", [
    ([(Send(1, D, 0), Recv(1, Region("data", 2, 4), 0))], "overlap"),
    ([(Recv(1, D, 0), Recv(1, Region("data", 3, 1), 0))], "overlap"),
    ([(Copy(D, Region("data", 2, 4)),)], "overlap"),
    ([(Send(1, Region("data", 6, 4), 0),)], "outside"),
    ([(Send(1, Region("output", 0, 1), 0),)], "does not have"),
    ([(Send(5, D, 0),)], "peer 5"),
    ([(Send(0, D, 0),)], "peer 0"),
    ([(Copy(D, Region("data", 4, 3)),)], "different sizes"),
])
def test_rule_violations(steps, match):
    with pytest.raises(ScheduleError, match=match):
        _run(steps, [(Recv(0, Region("data", 4, 4), 0),)])


def test_deadlock_is_reported():
    with pytest.raises(ScheduleError, match="deadlock.*rank 0 at step 0.*rank 1"):
        _run([(Recv(1, D, 0),), (Send(1, D, 0),)], [(Recv(0, D, 0),), (Send(0, D, 0),)])


def test_tag_mismatch_deadlocks_and_leftovers_are_reported():
    with pytest.raises(ScheduleError, match="deadlock"):
        _run([(Send(1, D, 1),)], [(Recv(0, D, 2),)])
    with pytest.raises(ScheduleError, match="never received.*rank 0 to rank 1 with tag 3"):
        _run([(Send(1, D, 3),)], [])


def test_size_mismatch_is_reported():
    with pytest.raises(ScheduleError, match="sizes must agree"):
        _run([(Send(1, D, 0),)], [(Recv(0, Region("data", 0, 3), 0),)])


# -- the shared arithmetic --------------------------------------------------------------


def test_chunk_arithmetic():
    assert chunks.split(10, 4) == (3, 3, 2, 2) and chunks.offsets((3, 3, 2, 2)) == (0, 3, 6, 8)
    assert [r.count for r in chunks.segments(Region("d", 5, 10), 4)] == [4, 4, 2]
    assert chunks.segments(Region("d", 0, 0), 4) == ()
    assert chunks.wrap_pieces(3, 3, 4) == ((3, 1), (0, 2))
    assert [chunks.pow2_floor(n) for n in (1, 2, 3, 8, 9)] == [1, 2, 2, 8, 8]
    assert [chunks.ceil_log2(n) for n in (1, 2, 3, 8, 9)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("world", [1, 2, 5, 8, 13])
def test_tree_and_fold_are_consistent(world):
    for root in range(world):
        below = 0
        for rank in range(world):
            for child in chunks.tree_children(rank, world, root):
                assert chunks.tree_parent(child, world, root) == rank
            below += chunks.tree_parent(rank, world, root) is not None
        assert below == world - 1
        assert chunks.subtree_size(root, world, root) == world
    cores = [chunks.fold(rank, world)[0] for rank in range(world)]
    live = [c for c in cores if c is not None]
    assert sorted(live) == list(range(chunks.pow2_floor(world)))
    assert all(chunks.core_rank(c, world) == r for r, c in enumerate(cores) if c is not None)
