"""The TCP latency lane (chorus.components.tcp_lane): a small synchronous all_reduce on a
group without a shared-memory window runs from a cached plan, with the general path's
bits, sequence numbers, mismatch and failure errors.  Ranks are threads over the loopback
transport (``CHORUS_TRANSPORT=tcp``: no window; the lane moves frames through the
transport's isend/irecv/wait_all, which TCP and loopback share) and, once, processes over
TCP."""

import threading

import numpy as np
import pytest

import chorus as dist
from chorus import config, recorder
from chorus.components.tcp_lane import TcpLane
from chorus.testing import run_processes, run_threads
from chorus.transport.loopback import LoopbackFabric

pytestmark = pytest.mark.usefixtures("job")

CASES = [  # (dtype, op, element counts)
    ("float32", "SUM", (1, 7, 1000, 9000)),
    ("float64", "PRODUCT", (3, 513)),
    ("float16", "SUM", (5, 2048)),
    ("float32", "AVG", (1, 33)),
    ("float64", "MIN", (17,)),
    ("int32", "SUM", (1, 100)),
    ("int64", "BXOR", (64,)),
    ("uint8", "MAX", (9,)),
    ("bool", "SUM", (12,)),
    ("complex64", "SUM", (6,)),
    ("complex128", "PRODUCT", (6, 33)),  # numpy's complex multiply: not commutative bit for bit
]


@pytest.fixture(autouse=True)
def tcp(monkeypatch):
    monkeypatch.setenv("CHORUS_TRANSPORT", "tcp")


def _inputs(rank, dtype, n, seed):
    """Values whose reductions round (random floats), so a different order gives other bits."""
    rng = np.random.default_rng(seed * 101 + rank)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    if dtype.startswith("complex"):
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype)
    if dtype.startswith("float"):
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)
    return rng.integers(0, 100, n).astype(dtype)


def _every_case(rank, world):
    """Every case through the API (the lane where it applies), and what the lane ran."""
    out = {}
    for k, (dtype, op, counts) in enumerate(CASES):
        for n in counts:
            x = _inputs(rank, dtype, n, k)
            dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
            out[(dtype, op, n)] = x
    lane = dist.group.WORLD.lane
    out["lane"] = type(lane).__name__, len(lane.reduce_log) if lane is not None else 0
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_lane_gives_the_general_paths_bits_on_every_rank(world):
    with config.override(CHORUS_TCP_LANE_BYTES=0):  # the lane off: the general path
        general = run_threads(_every_case, world)
    lane = run_threads(_every_case, world)
    ops = sum(len(counts) for _, _, counts in CASES)
    assert all(r.pop("lane") == ("TcpLane", 0) for r in general)
    assert all(r.pop("lane") == ("TcpLane", ops) for r in lane)
    for key in general[0]:
        for rank in range(world):
            assert lane[rank][key].dtype == general[0][key].dtype
            assert lane[rank][key].tobytes() == general[0][key].tobytes(), (key, rank)
            assert general[rank][key].tobytes() == general[0][key].tobytes(), (key, rank)


def test_torch_tensors_take_the_lane():
    torch = pytest.importorskip("torch")

    def body(rank, world):
        t = torch.full((2, 3), float(rank + 1))
        for _ in range(3):
            dist.all_reduce(t)
        b = torch.ones(4, dtype=torch.bfloat16)  # no numpy view: the general path
        dist.all_reduce(b)
        return t.tolist(), b.tolist(), len(dist.group.WORLD.lane.reduce_log)

    for t, b, ops in run_threads(body, 2):
        assert t == [[12.0] * 3] * 2 and b == [2.0] * 4 and ops == 3


def _interleaved(rank, world):
    """Lane calls between every other kind of call, on the world and a sub-group; one
    rank's all_reduce through the general path (algorithm=) against the others' lane."""
    pg = dist.new_group(list(range(world)))
    got = []
    for i in range(4):
        x = np.full(5, rank + i, np.float64)
        dist.all_reduce(x)  # lane
        got.append(x[0])
        y = np.full(3, rank, np.int64)
        dist.all_reduce(y, algorithm="ring")  # general path
        got.append(y[0])
        z = np.full(4, float(rank), np.float32)
        dist.broadcast(z, src=i % world)
        got.append(z[0])
        big = np.ones(20000, np.float32)  # above CHORUS_TCP_LANE_BYTES: general path
        dist.all_reduce(big)
        got.append(big[0])
        w = dist.all_reduce(np.ones(2, np.float32), async_op=True)  # general path, queued
        s = np.ones(2, np.float32)
        dist.all_reduce(s)  # an async op is queued or running: the lane steps aside
        w.wait()
        got.append(s[0])
        u = np.full(2, rank, np.int32)
        dist.all_reduce(u, group=pg, algorithm="recursive_doubling" if rank == 0 else None)  # mixed
        got.append(u[0])
    dist.barrier()
    return got, len(dist.group.WORLD.lane.reduce_log), len(pg.lane.reduce_log)


def test_lane_and_general_calls_interleave():
    with config.override(CHORUS_TCP_LANE_BYTES=1024):
        results = run_threads(_interleaved, 3)
    total = sum(range(3))
    want = []
    for i in range(4):
        want += [3 * i + total, total, float(i % 3), 3.0, 3.0, total]
    for got, world_ops, _ in results:
        assert got == want
        assert world_ops >= 4  # the small all_reduce at least; the one after the async op may step aside
    assert [r[2] for r in results] == [0, 4, 4]  # rank 0 asked for the algorithm: the general path


def test_mismatch_with_a_lane_call_raises_on_both_ranks():
    everyone = threading.Barrier(2)

    def body(rank, world):
        x = np.ones(8, np.float32)
        dist.all_reduce(x)  # lane, both ranks
        try:
            if rank == 0:
                dist.all_reduce(x)  # lane
            else:
                dist.broadcast(x, src=0)
        except dist.CollectiveMismatchError as exc:
            message = str(exc)
        else:
            message = "no error"
        everyone.wait(30)
        return message

    for rank, message in enumerate(run_threads(body, 2)):
        assert (f"(this rank is rank {rank}): rank 0 called all_reduce(float32, count=8, op=SUM) as op #1; "
                "rank 1 called broadcast(float32, count=8, root=0) as op #1") in message, message


def test_a_lost_peer_fails_the_lane_with_peer_lost():
    fabric = LoopbackFabric(3)
    everyone = threading.Barrier(3)

    def body(rank, world):
        x = np.ones(4, np.float32)
        dist.all_reduce(x)
        everyone.wait(30)
        if rank == 2:
            fabric.kill(2)
            return "killed"
        with pytest.raises(dist.PeerLostError, match="rank 2"):
            dist.all_reduce(x)
        return len(dist.group.WORLD.lane.reduce_log)

    assert run_threads(body, 3, fabric=fabric) == [2, 2, "killed"]


def test_a_silent_peer_times_out_naming_the_op():
    def body(rank, world):
        pg = dist.new_group([0, 1], timeout=0.3)
        if rank == 0:
            with pytest.raises(dist.CommTimeoutError, match=r"all_reduce \(seq 0\) .*no answer from ranks \[1\]"):
                dist.all_reduce(np.ones(2, np.float32), group=pg)
        else:
            threading.Event().wait(1.0)  # alive but silent
        return type(pg.lane).__name__

    assert run_threads(body, 2) == ["TcpLane", "TcpLane"]


def test_the_lane_steps_aside_for_a_recorder_and_a_thread_inside():
    seen = []
    recorder.attach(lambda e: seen.append((e.what, e.component)) if e.what == "begin" else None)
    try:
        def body(rank, world):
            dist.all_reduce(np.ones(2, np.float32))
            return len(dist.group.WORLD.lane.reduce_log)

        assert run_threads(body, 2) == [0, 0]
    finally:
        recorder.detach()
    assert seen == [("begin", "tcp")] * 2

    def inside(rank, world):
        pg = dist.group.WORLD
        pg.enter("all_reduce")  # as if another thread of this rank were inside one of its collectives
        try:
            return pg.lane.all_reduce_now(np.ones(2, np.float32), dist.ReduceOp.SUM)
        finally:
            pg.leave()

    assert run_threads(inside, 2) == [False, False]


def test_flight_recorder_names_the_lane():
    def body(rank, world):
        for _ in range(3):
            dist.all_reduce(np.ones(2, np.float32))
        entries = dist.group.WORLD.flight.entries()
        return [(e["op"], e["component"], e["algorithm"], e["lane"], e["state"]) for e in entries]

    for entries in run_threads(body, 2):
        assert entries == [("all_reduce", "tcp", "recursive_doubling", True, "done")] * 3


def test_lane_only_where_the_group_runs_over_tcp(monkeypatch):
    monkeypatch.setenv("CHORUS_TRANSPORT", "auto")

    def body(rank, world):
        return type(dist.group.WORLD.lane).__name__

    assert run_threads(body, 2) == ["ShmComponent"] * 2
    assert TcpLane.all_to_all_now(None, None, None) is False


def _processes_body(rank, world):
    out = _every_case(rank, world)
    out.pop("lane")
    return out, len(dist.group.WORLD.lane.reduce_log)


@pytest.mark.slow
def test_lane_over_real_tcp_matches_the_threads():
    threads = run_threads(_every_case, 3)
    procs = run_processes(_processes_body, 3)
    for rank in range(3):
        out, ops = procs[rank]
        assert ops == sum(len(counts) for _, _, counts in CASES)
        for key, value in out.items():
            assert value.tobytes() == threads[0][key].tobytes(), (key, rank)


def _shapes_body(rank, world):
    """all_reduce of arrays of several shapes, each three times (the cached plan again)."""
    out = []
    for shape in [(), (3,), (2, 3), (2, 1, 4)]:
        for k in range(3):
            x = np.array(np.arange(np.prod(shape, dtype=int)).reshape(shape) + 10 * k + rank, np.float32)
            dist.all_reduce(x)
            out.append((shape, k, x))
    return out, len(dist.group.WORLD.lane.reduce_log)


@pytest.mark.slow
def test_lane_over_real_tcp_keeps_each_arrays_shape():
    """W = 4 over TCP: two exchange rounds, each sending its snapshot (tcp_lane's plan runs
    the copy as the exchange's first part), on arrays of 0 to 3 dimensions."""
    world = 4
    for out, ops in run_processes(_shapes_body, world):
        assert ops == 12
        for shape, k, x in out:
            want = world * (np.arange(np.prod(shape, dtype=int)).reshape(shape) + 10 * k) + sum(range(world))
            assert x.shape == shape and np.array_equal(x, want.astype(np.float32)), (shape, k, x)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("op", ["MIN", "MAX"])
def test_signed_zeros_give_the_same_bits_on_every_rank(world, op):
    """MIN/MAX of 0.0 and -0.0 give the first operand's sign: a recursive-doubling
    exchange puts the lower rank's operand first on both partners, on the lane and on the
    general path."""

    def body(rank, world):
        got = []
        for lane in (64 << 10, 0):
            with config.override(CHORUS_TCP_LANE_BYTES=lane):
                x = np.array([0.0, -0.0, 1.0] if rank % 2 else [-0.0, 0.0, 1.0])
                dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                got.append(x.tobytes())
        return got

    results = run_threads(body, world)
    assert all(r == results[0] for r in results), results
