"""Registered buffers (chorus.shm.registered) and the collectives that map them
(chorus.shm.mapped): all_reduce and reduce on buffers every rank registered give the
bits of the copy path and really take the mapped path; a group where some rank has no
registered buffer falls back on every rank; the registry forgets buffers that died; real
processes map each other's files through /proc/<pid>/fd."""

import gc
import os

import numpy as np
import pytest
from proc_support import check_survivors, run_ranks

import chorus as dist
import chorus.shm.mapped as shm_mapped
from chorus.shm import registered
from chorus.testing import run_processes, run_threads

SLOT = 64 << 10  # several chunks on the copy path
N = 50_000  # elements: above the threshold below, not a multiple of any piece


@pytest.fixture
def mapped_from_16k(monkeypatch):
    """Registered buffers from 16 KiB, 64 KiB slots, no one-shot and no single copy, in the
    environment (spawned ranks and thread ranks read it when their group is created);
    counts the ops that took the mapped path."""
    monkeypatch.setenv("CHORUS_SHM_MAPPED_BYTES", str(16 << 10))
    monkeypatch.setenv("CHORUS_SHM_SLOT_BYTES", str(SLOT))
    monkeypatch.setenv("CHORUS_SHM_ONESHOT_BYTES", "0")
    monkeypatch.setenv("CHORUS_SHM_CMA_BYTES", str(1 << 62))
    taken = []  # ranks that ran mapped.all_reduce
    real_reduce, real_a2a = shm_mapped.all_reduce, shm_mapped.all_to_all
    monkeypatch.setattr(shm_mapped, "all_reduce", lambda win, *args: taken.append(win.rank) or real_reduce(win, *args))
    monkeypatch.setattr(shm_mapped, "all_to_all", lambda win, *args: taken.append(win.rank) or real_a2a(win, *args))
    return taken


def values(rank, n, dtype):
    v = np.random.default_rng(rank).standard_normal(n) * 100
    return (v if dtype != "int32" else v.round()).astype(dtype)


def reduce_case(rank, world, dtype, op, root, register):
    """all_reduce (root < 0) or reduce of ``values`` in a registered buffer (or a plain
    one where ``register(rank)`` is false)."""
    data = registered.empty_shared(N, dtype) if register(rank) else np.empty(N, dtype)
    data[...] = values(rank, N, dtype)
    if root < 0:
        dist.all_reduce(data, op=getattr(dist.ReduceOp, op))
    else:
        dist.reduce(data, dst=root, op=getattr(dist.ReduceOp, op))
    return data.copy()


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("dtype, op", [("float32", "SUM"), ("float16", "MAX"), ("int32", "SUM"),
                                       ("float32", "AVG")])
def test_all_reduce_on_registered_buffers_matches_the_copy_path_bit_for_bit(mapped_from_16k, world, dtype, op):
    mapped = run_threads(reduce_case, world, dtype, op, -1, lambda r: True)
    assert sorted(mapped_from_16k) == list(range(world))  # every rank took the mapped path
    plain = run_threads(reduce_case, world, dtype, op, -1, lambda r: False)
    assert len(mapped_from_16k) == world  # the plain buffers did not
    for got, want in zip(mapped, plain, strict=True):
        assert got.tobytes() == want.tobytes()
    exact = sum(values(r, N, dtype).astype(np.float64) for r in range(world))
    if op == "AVG":
        exact /= world
    if op == "SUM" or op == "AVG":
        np.testing.assert_allclose(mapped[0], exact, rtol=2e-3 if dtype == "float16" else 1e-5, atol=1e-3)


def test_reduce_writes_only_the_roots_buffer(mapped_from_16k):
    got = run_threads(reduce_case, 4, "float32", "SUM", 2, lambda r: True)
    want = sum(values(r, N, "float32") for r in range(4))
    np.testing.assert_allclose(got[2], want, rtol=1e-5)
    for r in (0, 1, 3):
        assert np.array_equal(got[r], values(r, N, "float32"))  # inputs of non-roots untouched


def test_a_rank_without_a_registered_buffer_sends_every_rank_down_the_copy_path(mapped_from_16k):
    got = run_threads(reduce_case, 4, "float32", "SUM", -1, lambda r: r != 1)
    assert mapped_from_16k == []
    plain = run_threads(reduce_case, 4, "float32", "SUM", -1, lambda r: False)
    assert all(g.tobytes() == p.tobytes() for g, p in zip(got, plain, strict=True))


def test_registry_finds_views_inside_a_registered_buffer_and_forgets_dead_ones():
    a = registered.empty_shared((4, 1000), np.float32)
    where = registered.find(a[1])
    assert where is not None and where.offset == 4000
    assert os.fstat(where.fd).st_ino == where.inode
    assert registered.find(np.empty(1000, np.float32)) is None
    address = a.__array_interface__["data"][0]
    del a, where
    gc.collect()
    assert address not in registered._entries


def proc_case(rank, world):
    taken = []
    real = shm_mapped.all_reduce
    shm_mapped.all_reduce = lambda win, *args: taken.append(1) or real(win, *args)
    data = registered.empty_shared(N, "float32")
    data[...] = values(rank, N, "float32")
    for _ in range(3):  # the second and third ops find the peers' files mapped already
        dist.all_reduce(data)
        data /= world
    return data.copy(), len(taken)


def test_processes_map_each_others_registered_buffers(mapped_from_16k):
    got = run_processes(proc_case, 3)
    want = values(0, N, "float32")
    for _ in range(3):
        want = sum(values(r, N, "float32") for r in range(3)) / 3 if _ == 0 else want
    for g, taken in got:
        assert taken == 3
        assert g.tobytes() == got[0][0].tobytes()
    np.testing.assert_allclose(got[0][0], want, rtol=1e-4)


def a2a_case(rank, world, splits, register):
    """all_to_all_single of rank-tagged values with ``splits[r][q]`` elements from r to q."""
    sends = splits[rank]
    inp = registered.empty_shared(sum(sends), "float32") if register(rank) else np.empty(sum(sends), np.float32)
    inp[...] = rank * 1_000_000 + np.arange(sum(sends))
    out = np.full(sum(splits[q][rank] for q in range(world)), -1, np.float32)
    dist.all_to_all_single(out, inp, [splits[q][rank] for q in range(world)], sends)
    want = np.concatenate([q * 1_000_000 + sum(splits[q][:rank]) + np.arange(splits[q][rank])
                           for q in range(world)]).astype(np.float32)
    return bool(np.array_equal(out, want))


@pytest.mark.parametrize("uneven", [False, True])
def test_all_to_all_reads_registered_inputs_of_every_rank(mapped_from_16k, uneven):
    world, n = 4, 9000
    splits = [[(r + q) % 3 * n // 2 + q if uneven else n for q in range(world)] for r in range(world)]
    taken = mapped_from_16k
    assert run_threads(a2a_case, world, splits, lambda r: True) == [True] * world
    assert sorted(taken) == list(range(world))
    taken.clear()
    assert run_threads(a2a_case, world, splits, lambda r: r != 2) == [True] * world
    assert taken == []  # one plain input: every rank takes the other path


def test_peers_files_stay_mapped_while_open_and_go_once_closed(mapped_from_16k, monkeypatch):
    """Ten buffers in turn: each stays mapped while its owner holds it (no remapping per op);
    once the owners drop them, the next new file lets them go."""
    opened = []
    real_map = shm_mapped.PeerMaps._map
    monkeypatch.setattr(shm_mapped.PeerMaps, "_map", lambda self, *a: opened.append(a[0]) or real_map(self, *a))

    def body(rank, world):
        arrays = [registered.empty_shared(N, "float32") for _ in range(10)]
        for _ in range(3):
            for a in arrays:
                a[...] = 1
                dist.all_reduce(a)
        maps = dist.group.WORLD.shm.window.maps
        held = maps.mapped(1 - rank)
        del arrays, a
        gc.collect()
        dist.barrier()  # both have closed their ten files
        fresh = registered.empty_shared(N, "float32")
        fresh[...] = 1
        dist.all_reduce(fresh)
        return held, maps.mapped(1 - rank), bool((fresh == 2).all())

    got = run_threads(body, 2)
    assert len(opened) == 2 * 11  # each rank mapped each of the other's 11 files once
    for held, after, right in got:
        assert held == 10 and after == 1 and right


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_offered_a_buffer_copy_phase_0_again_when_another_did_not(mapped_from_16k, world):
    """A rank with a registered buffer skips the copy path's first copy; when another rank
    has none, every rank runs that phase again (all_reduce, and all_to_all, uneven too)."""
    for missing in range(world):
        got = run_threads(reduce_case, world, "float32", "SUM", -1, lambda r, m=missing: r != m)
        plain = run_threads(reduce_case, world, "float32", "SUM", -1, lambda r: False)
        assert all(g.tobytes() == p.tobytes() for g, p in zip(got, plain, strict=True))
        splits = [[(r + q) % 3 * 4000 + q for q in range(world)] for r in range(world)]
        assert run_threads(a2a_case, world, splits, lambda r, m=missing: r != m) == [True] * world
    assert mapped_from_16k == []


@pytest.mark.parametrize("world", [3, 8])
def test_the_two_shot_lane_offers_no_buffer_and_meets_ranks_that_offered_one(mapped_from_16k, world, monkeypatch):
    """At a size where ranks may offer registered buffers and the array fits one slot, an
    unregistered array takes the latency path's two-shot plan, which offers none; a
    registered one takes the general path, which offers it (every rank mapped when all
    did).  A lane whose peer offered one goes on as the copy path does
    (collectives.all_reduce_offered), and a rank's offer of one op is not seen in a later
    one.  Every mix gives the copy path's bits."""
    from chorus.shm import collectives
    from chorus.shm.group import ShmGroup

    n = 12_000  # 48 KB: from 16 KiB (offered), within a 64 KiB slot (two-shot)
    planned, went_on = [], []
    lane = ShmGroup.all_reduce_planned
    monkeypatch.setattr(ShmGroup, "all_reduce_planned",
                        lambda self, pg, seq, plan, data: (planned.append(plan.offer), lane(self, pg, seq, plan, data))[1])
    offered = collectives.all_reduce_offered
    monkeypatch.setattr(collectives, "all_reduce_offered",
                        lambda win, *args: (went_on.append(win.rank), offered(win, *args))[1])
    # per step (two ops each): who registers, and who calls async (the general path, unregistered);
    # "none" again after the others, so that an offer left from an earlier op would show
    steps = [(frozenset(), frozenset()), (frozenset(range(world)), frozenset()), (frozenset({1}), frozenset()),
             (frozenset(), frozenset({0})), (frozenset(), frozenset())]

    def body(rank, world):
        shared, plain, out = registered.empty_shared(n, "float32"), np.empty(n, "float32"), []
        for who, general in steps:
            for _ in range(2):
                data = shared if rank in who else plain
                data[...] = values(rank, n, "float32")
                if rank in general:
                    dist.all_reduce(data, async_op=True).wait()
                else:
                    dist.all_reduce(data)
                out.append(data.tobytes())
        return out

    got = run_threads(body, world)
    assert planned == [True] * (2 * len(steps) * world - 2)  # (rank 0's async calls: not the lane)
    assert sorted(mapped_from_16k) == sorted(2 * list(range(world)))  # the step where all registered
    assert sorted(went_on) == sorted(2 * [q for q in range(world) if q != 1])  # the step where rank 1 did
    assert all(results == [got[0][0]] * len(results) for results in got)  # every op, every rank: the same bits
    want = sum(values(r, n, "float32").astype(np.float64) for r in range(world))
    np.testing.assert_allclose(np.frombuffer(got[0][0], np.float32), want, rtol=1e-4, atol=1e-2)


_KILL = """
import os, signal, sys, time, numpy as np, chorus as dist
import chorus.shm.direct as direct
victim, outdir = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
assert dist.group.WORLD.shm.window.maps is not None
x = dist.empty_shared(1 << 20, np.float32)
x[...] = 1
if rank == victim:
    opened = direct.open_op
    def die_after_offering(*args):  # the others are about to read and write its buffer
        opened(*args)
        open(f"{outdir}/killed", "w").write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    direct.open_op = die_after_offering
try:
    for _ in range(3):
        dist.all_reduce(x)
    sys.exit(4)
except dist.PeerLostError as exc:
    open(f"{outdir}/rank{rank}", "w").write(repr(time.time()) + "\\n" + str(exc))
    sys.exit(3)
"""


def test_a_peer_killed_in_a_mapped_all_reduce_gives_peer_lost_within_5s(tmp_path):
    import signal
    import sys

    world, victim = 3, 1
    script = tmp_path / "kill.py"
    script.write_text(_KILL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHORUS_SHM")}
    procs, outs = run_ranks([sys.executable, str(script), str(victim), str(tmp_path)], world, env, timeout=90)
    assert procs[victim].returncode == -signal.SIGKILL, outs[victim][1]
    for rank in set(range(world)) - {victim}:
        assert procs[rank].returncode == 3, outs[rank][1]
    check_survivors(tmp_path, world, victim)


def bf16_case(rank, world):
    import torch

    bits = registered.empty_shared(N, np.uint16)
    t = torch.from_numpy(bits).view(torch.bfloat16)
    t[...] = torch.from_numpy(values(rank, N, "float32")).to(torch.bfloat16)
    dist.all_reduce(t)
    return t.float().numpy().copy()


def test_bfloat16_on_registered_buffers(mapped_from_16k):
    pytest.importorskip("torch")
    got = run_threads(bf16_case, 3)
    assert sorted(mapped_from_16k) == [0, 1, 2]
    want = sum(np.asarray(values(r, N, "float32"), np.float64) for r in range(3))
    np.testing.assert_allclose(got[0], want, rtol=0.05, atol=2.0)
    assert all(g.tobytes() == got[0].tobytes() for g in got)


def test_a_killed_process_not_yet_reaped_counts_as_gone():
    """A dead peer keeps its /proc entry (no descriptors) until reaped: mapping its buffer
    then reports the death (PeerGone), not a buffer closed mid-op."""
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while shm_mapped._running(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # exits, stays a zombie: nobody waits for it yet
    assert os.path.exists(f"/proc/{child.pid}") and not shm_mapped._running(child.pid)
    child.wait()
    assert shm_mapped._running(os.getpid())


def test_the_registry_drops_dead_buffers_as_it_grows(monkeypatch):
    monkeypatch.setattr(registered, "_SWEEP_AT", 8)
    keep = [registered.empty_shared(16, np.float32) for _ in range(4)]
    fd = os.memfd_create("test")
    try:
        os.ftruncate(fd, 4096)
        for i in range(20):  # registrations whose owners say they died at once
            registered.register(10_000 + i * 4096, 4096, fd, lambda: False)
        assert len(registered._entries) <= 8 + 1 + len(keep)
        assert all(registered.find(a) is not None for a in keep)
    finally:
        for i in range(20):
            registered.unregister(10_000 + i * 4096)
        os.close(fd)
