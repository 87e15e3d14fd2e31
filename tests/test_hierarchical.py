"""Hierarchical collectives (chorus.components.hierarchy) on simulated hosts (``CHORUS_HOST_ID``):
every collective, dtype and reduce op gives the flat TCP algorithms' result bit for bit
(inputs are small integers, so every reduction order is exact), on 2+2, 3+2, 1+3 and
interleaved hosts, every root, sub-groups, async ops, algorithm forcing; a mismatch and
a killed rank (real processes) fail fast on every host."""

import collections
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from hier_support import LAYOUTS, bits, values

import chorus as dist
from chorus import recorder
from chorus.components.hierarchy import HIDDEN
from chorus.testing import run_threads

torch = pytest.importorskip("torch")

FLAT = {"all_reduce": "ring", "reduce": "binomial", "broadcast": "binomial", "all_gather": "ring",
        "reduce_scatter": "pairwise", "barrier": "dissemination"}
DTYPES = ["float32", "float64", "int64", "bfloat16"]
FLOAT_OPS = ["SUM", "MAX", "PRODUCT", "AVG", "PREMUL_SUM"]
INT_OPS = ["SUM", "MAX", "PRODUCT"]


pytestmark = pytest.mark.usefixtures("job")  # a job id of its own, no shared-memory file left


@pytest.fixture
def recorded():
    """What the recorder saw: (event, op name, group id, component) per op begin and end."""
    seen = []

    def listen(e):
        if e.what in ("begin", "end"):
            seen.append((e.what, e.op, e.group, e.component))

    recorder.attach(listen)
    yield seen
    recorder.detach()


def zeros(n, dtype):
    return torch.zeros(n, dtype=torch.bfloat16) if dtype == "bfloat16" else np.zeros(n, dtype)


def reduce_op(op):
    return dist._make_nccl_premul_sum(0.5) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)


class Compare:
    """Runs a call once by default (hierarchical) and once with the flat algorithm, and
    collects the calls whose tensors differ; counts the default calls per collective."""

    def __init__(self, group=None):
        self.group = group
        self.wrong = []
        self.calls = collections.Counter()

    def __call__(self, what, collective, call):
        hier = [bits(t) for t in call(None)]
        flat = [bits(t) for t in call(FLAT[collective])]
        self.calls[collective] += 1
        if len(hier) != len(flat) or any(not np.array_equal(a, b) for a, b in zip(hier, flat, strict=True)):
            self.wrong.append((what, hier, flat))


def reductions(cmp, rank, w, dtype, op, roots, n=5):
    """all_reduce, reduce (each root), reduce_scatter_tensor and uneven reduce_scatter."""
    g, rop = cmp.group, reduce_op(op)

    def all_reduce(algo):
        t = values(rank, n, dtype)
        dist.all_reduce(t, op=rop, group=g, algorithm=algo)
        return [t]

    def reduce(root):
        def call(algo):
            t = values(rank, n, dtype)
            dist.reduce(t, group_dst=root, op=rop, group=g, algorithm=algo)
            return [t]  # non-roots must keep their input
        return call

    def reduce_scatter_tensor(algo):
        src = torch.cat([values(rank, n, dtype, q) for q in range(w)]) if dtype == "bfloat16" else \
            np.concatenate([values(rank, n, dtype, q) for q in range(w)])
        out = zeros(n, dtype)
        dist.reduce_scatter_tensor(out, src, op=rop, group=g, algorithm=algo)
        return [out, src]

    def reduce_scatter(algo):  # uneven: rank q gets q + 1 elements
        me = dist.get_rank(g)
        out = zeros(me + 1, dtype)
        dist.reduce_scatter(out, [values(rank, q + 1, dtype, q) for q in range(w)], op=rop, group=g,
                            algorithm=algo)
        return [out]

    cmp(f"all_reduce {dtype} {op}", "all_reduce", all_reduce)
    for root in roots:
        cmp(f"reduce {dtype} {op} dst={root}", "reduce", reduce(root))
    cmp(f"reduce_scatter_tensor {dtype} {op}", "reduce_scatter", reduce_scatter_tensor)
    cmp(f"reduce_scatter {dtype} {op}", "reduce_scatter", reduce_scatter)


def movements(cmp, rank, w, dtype, roots, n=5):
    """broadcast (each root), all_gather, all_gather_into_tensor, barrier."""
    g = cmp.group

    def broadcast(root):
        def call(algo):
            t = values(rank, n, dtype)
            dist.broadcast(t, group_src=root, group=g, algorithm=algo)
            return [t]
        return call

    def all_gather(algo):
        outs = [zeros(n, dtype) for _ in range(w)]
        dist.all_gather(outs, values(rank, n, dtype), group=g, algorithm=algo)
        return outs

    def all_gather_into_tensor(algo):
        out = zeros(w * n, dtype)
        dist.all_gather_into_tensor(out, values(rank, n, dtype), group=g, algorithm=algo)
        return [out]

    def barrier(algo):
        dist.barrier(group=g, algorithm=algo)
        return []

    for root in roots:
        cmp(f"broadcast {dtype} src={root}", "broadcast", broadcast(root))
    cmp(f"all_gather {dtype}", "all_gather", all_gather)
    cmp(f"all_gather_into_tensor {dtype}", "all_gather", all_gather_into_tensor)
    cmp("barrier", "barrier", barrier)


def everything(cmp, rank, w):
    """Every collective x dtype x op; every root for SUM, the last rank for the other ops."""
    for dtype in DTYPES:
        movements(cmp, rank, w, dtype, range(w))
        for op in INT_OPS if dtype == "int64" else FLOAT_OPS:
            reductions(cmp, rank, w, dtype, op, range(w) if op == "SUM" else [w - 1])


def hierarchical_begins(seen, group=0):
    return collections.Counter(name for event, name, g, how in seen
                               if event == "begin" and g == group and how == "hierarchical")


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "2+2"])  # 2+2: the grid's, vs numpy
def test_every_collective_dtype_and_op_matches_the_flat_path_bit_for_bit(layout, monkeypatch, recorded):
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS[layout])
    w = len(LAYOUTS[layout].split(","))

    def body(rank, world):
        assert dist.group.WORLD.hierarchy is not None and dist.group.WORLD.shm is None
        cmp = Compare()
        everything(cmp, rank, world)
        return cmp.wrong, cmp.calls

    results = run_threads(body, w)
    for rank, (wrong, _) in enumerate(results):
        assert not wrong, (layout, rank, wrong[:2])
    calls = results[0][1]
    assert set(calls) == set(FLAT)
    begins = hierarchical_begins(recorded)
    # all_gather_into_tensor runs as all_gather; every default call was hierarchical on every rank
    assert begins == {name: count * w for name, count in calls.items()}, begins
    shm_groups = {g for event, _, g, how in recorded if how == "shm"}
    assert shm_groups and all(g & HIDDEN for g in shm_groups)  # the intra-host phases
    assert not any(g == 0 and how == "shm" for _, _, g, how in recorded)


def test_sub_groups_that_span_hosts_are_hierarchical_and_destroyed_with_their_parent(monkeypatch, recorded):
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["3+2"])  # ranks 0, 1, 2 on a; 3, 4 on b

    def body(rank, w):
        spans = dist.new_group([1, 2, 4])  # a, a, b: hierarchical
        one_each = dist.new_group([0, 3])  # a, b: nothing to split, flat TCP
        same_host = dist.new_group([3, 4])  # b, b: shared memory
        out = {}
        if rank in (1, 2, 4):
            cmp = Compare(spans)
            for dtype in ("float32", "int64"):
                movements(cmp, rank, 3, dtype, range(3))
                reductions(cmp, rank, 3, dtype, "SUM", range(3))
            out["wrong"], out["calls"], out["id"] = cmp.wrong, cmp.calls, spans.id
            local = spans.hierarchy.local
            dist.destroy_process_group(spans)
            out["closed"] = local.shm.closed
        if rank in (0, 3):
            out["one_each"] = (one_each.hierarchy, one_each.shm)
        if rank in (3, 4):
            out["same_host"] = (same_host.hierarchy, same_host.shm is not None)
        x = np.full(2, rank, np.int64)
        dist.all_reduce(x)  # the world is unaffected by its sub-groups
        out["world"] = int(x[0])
        return out

    results = run_threads(body, 5)
    assert all(r["world"] == 10 for r in results)
    for rank in (1, 2, 4):
        assert not results[rank]["wrong"], results[rank]["wrong"][:2]
        assert results[rank]["closed"]
    assert results[0]["one_each"] == (None, None) and results[3]["one_each"] == (None, None)
    assert results[3]["same_host"] == (None, True)
    begins = hierarchical_begins(recorded, results[1]["id"])
    assert begins == {name: n * 3 for name, n in results[1]["calls"].items()}


def test_async_ops_keep_issue_order_and_results(monkeypatch, recorded):
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["3+2"])

    def body(rank, w):
        xs = [np.full(10 * (i + 1), rank + i, np.int64) for i in range(8)]
        works = [dist.all_reduce(x, async_op=True) for x in xs]
        flat = np.full(3, rank, np.int64)
        dist.all_reduce(flat, algorithm="ring", async_op=True)  # flat, queued in between
        b = np.full(4, rank, np.int64)
        dist.broadcast(b, src=4)  # synchronous, queued behind the async ones
        outs = [np.zeros(2, np.int64) for _ in range(w)]
        gathered = dist.all_gather(outs, np.full(2, rank, np.int64), async_op=True)
        barrier = dist.barrier(async_op=True)
        assert gathered.wait() and barrier.wait() and gathered.is_success()
        for work in works:
            work.wait()
        total = dist.all_reduce(np.ones(2), async_op=True).get_future().wait()[0]
        return [int(x[0]) for x in xs], int(flat[0]), int(b[0]), [int(o[0]) for o in outs], total.tolist()

    for xs, flat, b, gathered, total in run_threads(body, 5):
        assert xs == [10 + 5 * i for i in range(8)] and flat == 10 and b == 4
        assert gathered == list(range(5)) and total == [5.0, 5.0]
    assert hierarchical_begins(recorded) == {"all_reduce": 45, "broadcast": 5, "all_gather": 5, "barrier": 5}


def test_algorithm_and_environment_choose_flat_or_hierarchical(monkeypatch, recorded):
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["2+2"])
    monkeypatch.setenv("CHORUS_ALGO_ALL_REDUCE", "ring")  # read when groups are created
    monkeypatch.setenv("CHORUS_ALGO_BROADCAST", "hierarchical")

    def body(rank, w):
        x = np.full(3, rank, np.int64)
        dist.all_reduce(x)  # the environment says ring: flat
        dist.all_reduce(x, algorithm="hierarchical")  # the argument wins
        dist.broadcast(x, src=1)
        pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]  # one host each
        start = pair.shm.sync.count
        y = np.full(2, rank, np.int64)
        dist.broadcast(y, src=pair.members[1], group=pair)  # hierarchical on one host: shared memory
        outs = [np.zeros(2, np.int64) for _ in range(2)]
        dist.all_gather(outs, y, group=pair, algorithm="hierarchical")
        with pytest.raises(dist.InvalidArgumentError, match="unknown algorithm 'hierarchical'"):
            dist.all_to_all_single(np.zeros(2), np.zeros(2), group=pair, algorithm="hierarchical")
        return x.tolist(), y.tolist(), pair.shm.sync.count - start

    results = run_threads(body, 4)
    assert [r[0] for r in results] == [[24] * 3] * 4  # 0+1+2+3, twice
    assert [r[1] for r in results] == [[1, 1], [1, 1], [3, 3], [3, 3]]
    assert all(r[2] >= 2 for r in results)
    assert hierarchical_begins(recorded) == {"all_reduce": 4, "broadcast": 4}


def test_a_mismatch_in_one_host_fails_every_rank_quickly(monkeypatch):
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["2+2"])

    def body(rank, w):
        dist.barrier()
        started = time.monotonic()
        with pytest.raises(dist.CollectiveMismatchError) as info:
            dist.all_reduce(np.ones(9 if rank == 3 else 8, np.float32))
        return time.monotonic() - started, str(info.value)

    results = run_threads(body, 4, op_timeout=20.0)
    calls = ("ranks [0-2] called all_reduce(float32, count=8, op=SUM) as op #1; "
             "rank 3 called all_reduce(float32, count=9, op=SUM) as op #1. ")
    for rank, (elapsed, message) in enumerate(results):  # the group's calls, not the phases'
        assert elapsed < 2.0 and f"on group 0 (this rank is rank {rank}): {calls}" in message, (rank, elapsed, message)


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, numpy as np, chorus as dist
    rank, victim, tmp, ready, everyone = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    count = int(sys.argv[6])
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=4, timeout=30)
    assert dist.group.WORLD.hierarchy is not None
    for _ in range(5):
        dist.all_reduce(np.ones(count))
    dist.barrier()
    if rank == victim:  # once every survivor (of both jobs) is about to enter the next all_reduce
        while len(os.listdir(ready)) < everyone:
            time.sleep(0.01)
        open(f"{tmp}/killed", "w").write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    open(f"{ready}/{os.getpid()}", "w").close()
    try:
        dist.all_reduce(np.ones(count))
    except dist.PeerLostError as exc:
        open(f"{tmp}/rank{rank}", "w").write(repr(time.time()) + "\\n" + str(exc))
        sys.exit(3)
""")
VICTIMS = (3, 0)  # a non-leader on host b; the leader of host a


@pytest.mark.parametrize("count, path", [(1000, "hierarchical"), (140_000, "ring")])
def test_a_killed_rank_makes_survivors_on_both_hosts_raise_peer_lost_within_5s(tmp_path, count, path):
    """One job per victim, started together; 8 KB of float64 runs the phases, 1.1 MB the ring."""
    script, ready = tmp_path / "kill.py", tmp_path / "ready"
    script.write_text(_KILL_SCRIPT)
    ready.mkdir()
    env = dict(os.environ, CHORUS_HOST_ID=LAYOUTS["2+2"], CHORUS_TOKEN="hier-kill-test",
               PYTHONPATH=os.pathsep.join(sys.path))
    jobs = {}
    for victim in VICTIMS:
        (tmp_path / f"victim{victim}").mkdir()
        jobs[victim] = [subprocess.Popen([sys.executable, str(script), str(rank), str(victim),
                                          str(tmp_path / f"victim{victim}"), str(ready), str(3 * len(VICTIMS)),
                                          str(count)],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                        for rank in range(4)]
    outs = {}
    try:
        for victim, procs in jobs.items():
            outs[victim] = {rank: p.communicate(timeout=60) for rank, p in enumerate(procs) if rank != victim}
    finally:
        for procs in jobs.values():
            for p in procs:
                p.kill()
                p.communicate()
    for victim, procs in jobs.items():
        workdir = tmp_path / f"victim{victim}"
        killed_at = float((workdir / "killed").read_text())
        for rank, (_, err) in outs[victim].items():
            assert procs[rank].returncode == 3, (victim, rank, err[-2000:])
            when, message = (workdir / f"rank{rank}").read_text().split("\n", 1)
            assert float(when) - killed_at < 5.0, (victim, rank, message)
            assert f"rank {victim}" in message and "all_reduce" in message, (victim, rank, message)
            assert ("(hierarchical)" in message) == (path == "hierarchical"), (victim, rank, message)


def _lane_runs(monkeypatch):
    """Count, per group name, the runs of the hierarchy's lane and of the TCP lanes."""
    from chorus.components.hierarchy_lane import HierarchyLane
    from chorus.components.tcp_lane import TcpLane

    runs = collections.Counter()
    for cls in (HierarchyLane, TcpLane):
        original = cls._reduce_run

        def counted(self, seq, plan, arr, original=original):
            runs[self.pg.name.split("/")[-1]] += 1
            return original(self, seq, plan, arr)

        monkeypatch.setattr(cls, "_reduce_run", counted)
    return runs


@pytest.mark.parametrize("aside", ["none", "rank 0", "rank 1's column"])
def test_a_small_all_reduce_runs_in_each_host_then_in_each_column(monkeypatch, aside):
    """Hosts of equal size: a small all_reduce is an all_reduce in each host, then one in
    each column (rank i of every host), on the lane of the group and of its phases; a rank
    on the general path, or a phase whose lane steps aside, works with the others and
    every rank gets the same bits."""
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["2+2"])
    runs = _lane_runs(monkeypatch)

    def body(rank, w):
        pg = dist.group.WORLD
        assert pg.hierarchy.column is not None and pg.lane is not None
        if aside == "rank 0" and rank == 0:
            pg.lane = None  # the general path: Calls for the group and its phases
        if aside == "rank 1's column" and rank == 1:
            monkeypatch.setattr(pg.hierarchy.column.lane, "all_reduce_now", lambda *a: False)
        out = []
        for salt in range(3):
            x = (np.arange(5, dtype=np.float64) + 1) * (rank + 1) / 3 + salt  # inexact sums: order shows
            dist.all_reduce(x)
            out.append(x)
        return out

    results = run_threads(body, 4)
    for rank in range(1, 4):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(results[0], results[rank], strict=True)), rank
    expected = [sum((np.arange(5, dtype=np.float64) + 1) * (r + 1) / 3 + salt for r in range(4)) for salt in range(3)]
    np.testing.assert_allclose(results[0], expected)
    assert runs["WORLD"] == 3 * (4 - (aside == "rank 0")), runs  # 3 calls per rank on the group's lane
    assert runs["leaders"] == 3 * (2 - (aside == "rank 0")), runs  # ranks 0 and 2: the first column
    assert runs["column1"] == 3 * (2 - (aside == "rank 1's column")), runs  # ranks 1 and 3


def test_hosts_of_different_sizes_have_no_columns_and_no_group_lane(monkeypatch):
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["3+2"])

    def body(rank, w):
        pg = dist.group.WORLD
        x = np.full(3, float(rank))
        dist.all_reduce(x)
        return pg.hierarchy.column, pg.lane, x

    for column, lane, x in run_threads(body, 5):
        assert column is None and lane is None and list(x) == [10.0] * 3


@pytest.mark.parametrize(("count", "phases"), [
    (40_000, ["reduce_scatter", "all_reduce", "all_gather"]),  # 320 KiB: blocks of the host's sums per column
    (40_001, ["reduce", "all_reduce", "broadcast"]),  # the host's size does not divide it: the leaders' path
])
def test_a_large_all_reduce_splits_the_hosts_traffic_among_the_columns(monkeypatch, recorded, count, phases):
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["2+2"])

    def body(rank, w):
        x = values(rank, count, "float64")
        dist.all_reduce(x)
        return x

    results = run_threads(body, 4)
    expected = sum(values(r, count, "float64") for r in range(4))
    for x in results:
        assert x.tobytes() == expected.tobytes()
    seen = [name for event, name, g, how in recorded if event == "begin" and g & HIDDEN]
    # each rank's phases, in order: on its host's group, its column or the leaders, its host's group
    assert collections.Counter(seen) == collections.Counter(
        {name: (4 if i != 1 or phases[0] != "reduce" else 2) for i, name in enumerate(phases)}), seen


@pytest.mark.parametrize("theirs", ["count", "dtype"])
def test_hosts_that_call_on_either_side_of_the_column_size_see_the_mismatch_at_once(monkeypatch, theirs):
    """Host a's ranks call a small all_reduce (two phases), host b's a large one (other
    phases): the leaders meet on the first column, which is their group, so every rank
    raises CollectiveMismatchError at once instead of waiting in different groups."""
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["2+2"])

    def body(rank, w):
        small = np.ones(1000)
        large = np.ones(10_000) if theirs == "count" else np.ones(1000, np.float32)
        dist.barrier()
        started = time.monotonic()
        with pytest.raises(dist.CollectiveMismatchError):
            dist.all_reduce(small if rank < 2 else large)
        return time.monotonic() - started

    assert max(run_threads(body, 4, op_timeout=20.0)) < 5.0

