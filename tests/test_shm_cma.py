"""Single copy through Cross Memory Attach (chorus.shm.cma): every collective, in real
processes, with CMA on and off around the threshold (uneven all_to_all, every root,
several dtypes), bit-identical to the copy path and checked to have really read peers'
memory where it has a single-copy path (and not where it has none: broadcast and
reduce_scatter); the window-creation probe and its unanimous verdict;
CHORUS_SHM_CMA=0; a peer killed in the middle of a single-copy op; the binding's errors."""

import ctypes
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from cma_support import Ctx
from proc_support import check_survivors, run_ranks

import chorus as dist
import chorus.shm.direct as shm_direct
from chorus.shm import cma
from chorus.testing import run_processes, run_threads

THRESHOLD = 16 << 10  # CHORUS_SHM_CMA_BYTES in these tests
SLOT = 64 << 10  # CHORUS_SHM_SLOT_BYTES: large messages take several chunks
SIZES = (4095, 4096, 50_000)  # elements: around the threshold (float32: just below, at) and above
DTYPES = ("float32", "float16", "int32", "complex64")


@pytest.fixture
def small_thresholds(monkeypatch):
    """Single copy from 16 KiB, 64 KiB slots, no one-shot all_reduce, in the environment:
    spawned ranks and thread ranks read it when their group is created."""
    monkeypatch.setenv("CHORUS_SHM_CMA_BYTES", str(THRESHOLD))
    monkeypatch.setenv("CHORUS_SHM_SLOT_BYTES", str(SLOT))
    monkeypatch.setenv("CHORUS_SHM_ONESHOT_BYTES", "0")
    monkeypatch.delenv("CHORUS_SHM_CMA", raising=False)


def values(seed, n, dtype):
    """Random numbers (floats with all their bits in use, so summation order shows)."""
    rng = np.random.default_rng(seed)
    if dtype == "int32":
        return rng.integers(-1000, 1000, n).astype(np.int32)
    v = rng.standard_normal(n) * 100
    if dtype == "complex64":
        return (v + 1j * rng.standard_normal(n)).astype(np.complex64)
    return v.astype(dtype)


def uneven(world, n):
    """all_to_all split sizes: rank r sends (r + q) % 3 * n // 2 + q elements to rank q (some
    ranks send above the threshold, some below, one block is empty)."""
    return [[(r + q) % 3 * n // 2 + q for q in range(world)] for r in range(world)]


def run_case(case, rank, world, seed):
    """Run one collective; return (everything it wrote or left, its size as the single-copy
    decision counts it: the larger buffer, the largest sender's input for all_to_all)."""
    op, dtype, n, root = case
    mine = values(seed * 100 + rank, n, dtype)
    size = np.dtype(dtype).itemsize
    if op in ("all_reduce", "all_reduce_max", "reduce"):
        x = mine.copy()
        if op == "reduce":
            dist.reduce(x, dst=root)
        else:
            dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "all_reduce_max" else dist.ReduceOp.SUM)
        return [x], n * size
    if op == "broadcast":
        x = mine.copy()
        dist.broadcast(x, src=root)
        return [x], n * size
    if op == "all_gather":
        out = np.zeros(world * n, dtype)
        dist.all_gather_into_tensor(out, mine)
        return [out], world * n * size
    if op == "all_gather_in_place":  # FSDP's way: the input is this rank's block of the output
        out = np.zeros(world * n, dtype)
        out[rank * n:(rank + 1) * n] = mine
        dist.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n])
        return [out], world * n * size
    if op == "gather":
        outs = [np.zeros(n, dtype) for _ in range(world)] if rank == root else None
        dist.gather(mine, outs, dst=root)
        return outs or [], world * n * size
    if op == "scatter":
        out = np.zeros(n, dtype)
        dist.scatter(out, [values(seed * 100 + 50 + q, n, dtype) for q in range(world)] if rank == root else None,
                     src=root)
        return [out], world * n * size
    if op == "reduce_scatter":
        out = np.zeros(n, dtype)
        dist.reduce_scatter_tensor(out, np.concatenate([mine] * world))
        return [out], world * n * size
    if op == "reduce_scatter_uneven":
        counts = [n // 2 + 7 * q for q in range(world)]
        out = np.zeros(counts[rank], dtype)
        dist.reduce_scatter(out, [values(seed * 100 + rank * 10 + q, c, dtype) for q, c in enumerate(counts)])
        return [out], sum(counts) * size
    if op == "all_to_all":
        out = np.zeros(world * n, dtype)
        dist.all_to_all_single(out, np.concatenate([mine] * world) + np.arange(world * n).astype(dtype))
        return [out], world * n * size
    if op == "all_to_all_uneven":
        table = uneven(world, n)
        send, recv = table[rank], [table[r][rank] for r in range(world)]
        out = np.zeros(sum(recv), dtype)
        dist.all_to_all_single(out, values(seed * 100 + rank, sum(send), dtype),
                               output_split_sizes=recv, input_split_sizes=send)
        return [out], max(sum(row) for row in table) * size
    raise AssertionError(op)


OPS = ("all_reduce", "all_reduce_max", "reduce", "broadcast", "all_gather", "all_gather_in_place",
       "gather", "scatter", "reduce_scatter", "reduce_scatter_uneven", "all_to_all", "all_to_all_uneven")
#: The collectives without a single-copy path (chorus.shm.direct.MEASURED): always the copy path.
COPY_ONLY = ("broadcast", "reduce_scatter", "reduce_scatter_uneven")
ROOTED = ("reduce", "broadcast", "gather", "scatter")


def cases(world):
    for op in OPS:
        for dtype in DTYPES:
            if op == "all_reduce_max" and dtype == "complex64":
                continue
            for n in SIZES:
                for root in ({0, world - 1} if op in ROOTED else {0}):
                    yield op, dtype, n, root


def _copy_vs_single_copy(rank, world):
    """Every case twice, on the copy path (``window.cma`` off) and on single copy, in
    lockstep on every rank: the bytes they leave, and what single copy read."""
    shm = dist.group.WORLD.shm
    peers = shm.window.cma
    assert peers is not None, "the window creation probe failed in these processes"
    report = []
    for seed, case in enumerate(cases(world)):
        shm.window.cma = None
        dist.group.WORLD.lane.forget_plans()  # the API's one-shot plans depend on whether single copy is possible
        copied, criterion = run_case(case, rank, world, seed)
        shm.window.cma = peers
        dist.group.WORLD.lane.forget_plans()
        before, syncs = peers.nbytes, shm.sync.count
        direct, _ = run_case(case, rank, world, seed)
        same = len(copied) == len(direct) and all(
            a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in zip(copied, direct, strict=True))
        report.append((case, criterion, same, peers.nbytes - before, shm.sync.count - syncs))
    return report, peers.calls


def _short_complex_products(rank, world):
    """all_reduce PRODUCT of 1-3 complex64 elements on the copy path, then on single copy:
    (same bits, single copy used) per case."""
    shm = dist.group.WORLD.shm
    peers, report = shm.window.cma, []
    for seed in range(12):
        for n in (1, 3):
            x = values(seed * 10 + rank, n, "complex64")
            copied, direct = x.copy(), x.copy()
            shm.window.cma = None
            dist.group.WORLD.lane.forget_plans()
            dist.all_reduce(copied, op=dist.ReduceOp.PRODUCT)
            shm.window.cma = peers
            dist.group.WORLD.lane.forget_plans()
            calls = peers.calls
            dist.all_reduce(direct, op=dist.ReduceOp.PRODUCT)
            report.append((copied.tobytes() == direct.tobytes(), peers.calls > calls))
    return report


def test_single_copy_keeps_the_copy_paths_bits_for_short_complex_products(monkeypatch):
    """Groups of 2 reduce this rank's row in place, except complex dtypes (numpy's complex
    multiply of 1-element arrays gives other bits in place on some CPUs)."""
    monkeypatch.setenv("CHORUS_SHM_CMA_BYTES", "8")
    monkeypatch.setenv("CHORUS_SHM_ONESHOT_BYTES", "0")
    monkeypatch.delenv("CHORUS_SHM_CMA", raising=False)
    reports = run_processes(_short_complex_products, 2)
    assert all(same for report in reports for same, _ in report)
    assert any(used for report in reports for _, used in report)  # single copy ran


@pytest.mark.parametrize("world,threads", [(2, 1), (3, 3)])  # each world size, each side of the crew
def test_every_single_copy_collective_matches_the_copy_path_bit_for_bit(world, threads, small_thresholds,
                                                                         monkeypatch):
    monkeypatch.setenv("CHORUS_SHM_THREADS", str(threads))  # helper threads (chorus.shm.phases.Crew) ...
    monkeypatch.setenv("CHORUS_SHM_PART_BYTES", "1024")  # ... from 1 KiB per part and phase
    monkeypatch.setenv("CHORUS_SHM_COPY_CREW_BYTES", "0")  # ... of messages of any size
    results = run_processes(_copy_vs_single_copy, world)
    reports = [r for r, _ in results]
    assert all(calls > 0 for _, calls in results)
    sides = {criterion >= THRESHOLD for _, criterion, *_ in reports[0]}
    assert sides == {True, False}  # both sides of the threshold were run
    for i, (case, criterion, *_) in enumerate(reports[0]):
        same = [r[i][2] for r in reports]
        moved = sum(r[i][3] for r in reports)
        syncs = {r[i][4] for r in reports}
        assert all(same), (case, same)
        if criterion >= THRESHOLD and case[0] not in COPY_ONLY:
            assert moved > 0 and syncs == {2}, (case, criterion, moved, syncs)  # the single-copy path
        else:
            assert moved == 0, (case, criterion, moved)


def _reference_values(rank, world):
    """Single copy against numpy, for exact int32 data (several chunks)."""
    n = 50_000
    every = np.stack([values(r, n, "int32") for r in range(world)])
    x = every[rank].copy()
    dist.all_reduce(x)
    ok = [np.array_equal(x, every.sum(axis=0, dtype=np.int32))]
    out = np.zeros(world * n, np.int32)
    dist.all_gather_into_tensor(out, every[rank])
    ok.append(np.array_equal(out, every.reshape(-1)))
    out = np.zeros(n, np.int32)
    dist.reduce_scatter_tensor(out, np.tile(every[rank], world))
    ok.append(np.array_equal(out, every.sum(axis=0, dtype=np.int32)))
    x = every[rank].copy()
    dist.reduce(x, dst=1)
    ok.append(np.array_equal(x, every.sum(axis=0, dtype=np.int32) if rank == 1 else every[rank]))
    table = uneven(world, n)
    send = table[rank]
    inp = np.concatenate([np.full(c, rank * 100 + q, np.int32) for q, c in enumerate(send)])
    out = np.full(sum(table[r][rank] for r in range(world)), -1, np.int32)
    dist.all_to_all_single(out, inp, output_split_sizes=[table[r][rank] for r in range(world)],
                           input_split_sizes=send)
    ok.append(np.array_equal(out, np.concatenate([np.full(table[r][rank], r * 100 + rank, np.int32)
                                                  for r in range(world)])))
    return ok, dist.group.WORLD.shm.window.cma.nbytes


def test_single_copy_results_are_right_and_every_rank_read_its_peers(small_thresholds):
    for ok, moved in run_processes(_reference_values, 3):
        assert all(ok) and moved > 0, (ok, moved)


def _with_cma_off_on_rank(rank, world, off):
    """A new group created while rank ``off`` runs with CHORUS_SHM_CMA=0."""
    if rank == off:
        os.environ["CHORUS_SHM_CMA"] = "0"
    group = dist.new_group(list(range(world)))
    x = np.arange(100_000, dtype=np.float64) + rank
    dist.all_reduce(x, group=group)
    right = np.array_equal(x, np.arange(100_000, dtype=np.float64) * world + sum(range(world)))
    return dist.group.WORLD.shm.window.cma is not None, group.shm.window.cma is None, right


def test_one_member_with_cma_off_keeps_the_whole_group_on_the_copy_path(small_thresholds):
    for world_has_it, group_lacks_it, right in run_processes(_with_cma_off_on_rank, 3, 1):
        assert world_has_it and group_lacks_it and right


def test_chorus_shm_cma_0_gives_the_copy_path(small_thresholds, monkeypatch):
    monkeypatch.setenv("CHORUS_SHM_CMA", "0")

    def body(rank, world):
        x = np.ones(100_000, np.float32)
        dist.all_reduce(x)
        out = np.zeros(world * 100_000, np.float32)
        dist.all_gather_into_tensor(out, x)
        return dist.group.WORLD.shm.window.cma, bool((x == world).all() and (out == world).all())

    assert run_threads(body, 2) == [(None, True), (None, True)]


def test_ranks_as_threads_read_their_own_process(small_thresholds):
    def body(rank, world):
        peers = dist.group.WORLD.shm.window.cma
        x = np.full(100_000, rank + 1, np.float32)
        dist.all_reduce(x)
        out = np.zeros(world * 100_000, np.float32)
        dist.all_gather_into_tensor(out, np.full(100_000, rank, np.float32))
        right = (x == sum(range(1, world + 1))).all() and (out == np.repeat(np.arange(world), 100_000)).all()
        return peers is not None and peers.nbytes > 0, bool(right)

    assert run_threads(body, 3) == [(True, True)] * 3


# -- a peer killed in the middle of a single-copy op -----------------------------------------------

_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, numpy as np, chorus as dist
    import chorus.shm.direct as direct
    victim, outdir, op = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.group.WORLD.shm.window.cma is not None
    n = 1 << 20
    x, out = np.ones(n, np.float32), np.zeros(3 * n, np.float32)
    if rank == victim:
        opened = direct.open_op
        def die_after_publishing(*args):  # the others are about to read (or write) its buffer
            sources = opened(*args)
            open(f"{outdir}/killed", "w").write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        direct.open_op = die_after_publishing
    try:
        for _ in range(3):
            dist.all_reduce(x) if op == "all_reduce" else dist.all_gather_into_tensor(out, x)
        sys.exit(4)
    except dist.PeerLostError as exc:
        open(f"{outdir}/rank{rank}", "w").write(repr(time.time()) + "\\n" + str(exc))
        sys.exit(3)
""")


@pytest.mark.parametrize("op,threads", [("all_gather", 1), ("all_reduce", 1), ("all_gather", 3)])
def test_a_peer_killed_mid_single_copy_op_gives_peer_lost_within_5s(op, threads, tmp_path):
    """threads 3: the survivors' reads of the dead rank run on helper threads (chorus.shm.phases.Crew)."""
    world, victim = 3, 1
    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHORUS_SHM")}
    env.update(CHORUS_SHM_CMA_BYTES="4096", CHORUS_SHM_THREADS=str(threads))
    procs, outs = run_ranks([sys.executable, str(script), str(victim), str(tmp_path), op], world, env, timeout=90)
    assert procs[victim].returncode == -signal.SIGKILL, outs[victim][1]
    for rank in set(range(world)) - {victim}:
        assert procs[rank].returncode == 3, outs[rank][1]
    check_survivors(tmp_path, world, victim)


# -- the binding ------------------------------------------------------------------------------------


def test_probe_reads_and_writes_back_and_explains_failures():
    p = cma.Probe()
    me = os.getpid()
    assert cma.probe(0, [me, me], [0, p.address], [0, p.value]) is None
    assert p.cell.value == p.value  # written back unchanged
    assert "CHORUS_SHM_CMA=0" in cma.probe(0, [me, me], [0, 0], [0, 0])
    assert "another process" in cma.probe(0, [me, me], [0, p.address], [0, p.value + 1])
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert "ESRCH" in cma.probe(1, [child.pid, me], [p.address, 0], [p.value, 0])


def test_read_one_copies_goes_on_after_a_partial_transfer_and_counts():
    src = np.arange(70_000, dtype=np.int64)
    dst = np.zeros_like(src)
    peers = cma.Peers([os.getpid()] * 2)
    peers.read_one(Ctx, 1, cma.address(dst), cma.address(src), src.nbytes)
    # one call, unless these two arrays sit at a slow offset and the copy bounces (in pieces)
    slow = cma.slow(cma.address(dst), cma.address(src))
    one = 1 if not slow else peers.calls
    assert np.array_equal(dst, src) and (peers.calls, peers.nbytes) == (one, src.nbytes)
    real, stops = peers.readv, []

    def first_half(pid, local, n, remote, m, flags):  # the kernel may stop early
        if not stops:
            stops.append(local.len)
            local.len = remote.len = local.len // 2
        return real(pid, local, n, remote, m, flags)

    dst[:] = 0
    peers.readv = first_half
    peers.read_one(Ctx, 1, cma.address(dst), cma.address(src), src.nbytes)
    assert np.array_equal(dst, src) and len(stops) == 1
    if not slow:  # (at a slow offset the copy goes in pieces: the first stop is cut from a piece)
        assert stops == [src.nbytes] and (peers.calls, peers.nbytes) == (3, 2 * src.nbytes)


def _window_with_crew(rank: int, world: int, threads: int):
    from types import SimpleNamespace

    from chorus.shm.phases import Crew
    from chorus.shm.window import Settings

    return SimpleNamespace(rank=rank, world=world, crew=Crew(threads), settings=Settings.read())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_from_peers_reads_every_part_of_every_peer_once_and_the_local_share_once(threads):
    win = _window_with_crew(2, 5, threads)
    seen, lock = [], threading.Lock()

    def read(q, part, parts):
        with lock:
            seen.append((q, part, parts, threading.get_ident()))

    local = []
    shm_direct.from_peers(win, read, 4 * (3 << 20), lambda: local.append(threading.get_ident()))
    parts = {p for _, _, p, _ in seen}
    assert len(parts) == 1 and len(local) == 1
    (n,) = parts
    assert n == (1 if threads == 1 else 3)  # 3 MiB from each peer: 1 MiB pieces
    assert sorted((q, part) for q, part, _, _ in seen) == [(q, k) for q in (0, 1, 3, 4) for k in range(n)]
    if threads == 1:
        assert [q for q, _, _, _ in seen] == [3, 4, 0, 1]  # from me + 1 on
    win.crew.close()


def test_from_peers_an_error_stops_the_other_threads_after_their_current_part():
    win = _window_with_crew(0, 3, 2)
    done, me = [], threading.get_ident()

    def read(q, part, parts):
        if threading.get_ident() == me:
            raise RuntimeError("boom")
        time.sleep(0.01)
        done.append((q, part))

    with pytest.raises(RuntimeError, match="boom"):
        shm_direct.from_peers(win, read, 2 * (64 << 20), lambda: None)  # 64 MiB per peer: 128 parts
    assert len(done) <= 2, done  # the helper's part under way when the caller failed, at most
    win.crew.close()


def test_from_peers_a_late_helper_reads_less():
    """The caller's thread takes the local share first and then whatever is left: a helper
    that starts late does not make the caller wait for a fixed share."""
    win = _window_with_crew(0, 3, 2)
    by_thread: dict[int, int] = {}
    gate = threading.Event()
    me = threading.get_ident()

    def read(q, part, parts):
        if threading.get_ident() != me:
            gate.wait(5)  # the helper is slow to start
        by_thread[threading.get_ident()] = by_thread.get(threading.get_ident(), 0) + 1
        if sum(by_thread.values()) >= 7:
            gate.set()

    shm_direct.from_peers(win, read, 2 * (4 << 20), lambda: None)  # 4 MiB per peer: 4 parts each
    assert sum(by_thread.values()) == 8
    assert by_thread[me] >= 7, by_thread
    win.crew.close()


def test_errors_name_the_op_and_rank_and_say_what_to_do():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    buf = np.zeros(4, np.int64)
    peers = cma.Peers([os.getpid(), child.pid])
    with pytest.raises(dist.PeerLostError, match="rank 11") as info:
        peers.read_one(Ctx, 1, cma.address(buf), cma.address(buf), 8)
    assert info.value.lost_rank == 11
    peers = cma.Peers([child.pid, os.getpid()])
    with pytest.raises(dist.AbortedError, match="rank 11's buffer is no longer mapped"):
        peers.read_one(Ctx, 1, cma.address(buf), 8, 8)  # address 8: never mapped

    def denied(*args):
        ctypes.set_errno(errno.EPERM)
        return -1

    peers.writev = denied
    with pytest.raises(cma.CmaError, match="CHORUS_SHM_CMA=0"):
        peers.write_one(Ctx, 1, cma.address(buf), cma.address(buf), 8)


def test_yama_scope_1_lets_peers_read(monkeypatch, tmp_path):
    calls = []
    scope = tmp_path / "ptrace_scope"
    monkeypatch.setattr(cma, "_YAMA", str(scope))
    monkeypatch.setattr(cma, "_prctl", lambda option, arg: calls.append((option, arg)))
    cma.allow_peers()  # no Yama: nothing to do
    for text in ("0\n", "2\n", "1\n"):  # only scope 1 is relaxed by the tracee
        scope.write_text(text)
        cma.allow_peers()
    assert calls == [(0x59616D61, 2**64 - 1)]  # PR_SET_PTRACER, PR_SET_PTRACER_ANY


def test_a_rank_failing_mid_single_copy_returns_only_after_its_peers_stopped(small_thresholds):
    """Rank 1 fails while reading; the others are still working on its buffer.  Rank 1
    must not get its buffer back before every other rank has finished with it (arrived
    at the closing sync or given up)."""
    import time

    from chorus.shm.sync import ABANDONED, ARRIVED, WORDS

    def body(rank, w):
        shm = dist.group.WORLD.shm
        if shm.window.cma is None:
            return "no single copy here"
        plain, calls = shm.window.cma.read_one, []

        def slow_or_failing(*args, **kwargs):
            if rank == 1:
                raise RuntimeError("boom")
            if not calls:
                time.sleep(0.3)  # still reading when rank 1 fails
            calls.append(1)
            return plain(*args, **kwargs)

        shm.window.cma.read_one = slow_or_failing
        x = np.ones(50_000, np.float32)
        try:
            dist.all_reduce(x)
        except Exception as exc:  # noqa: BLE001
            c, seq = shm.sync.control, shm.sync.count + 1
            done = [c[q * WORDS + ARRIVED] >= seq or c[q * WORDS + ABANDONED] > 0 for q in range(w)]
            return type(exc).__name__, done
        return "no error", []

    results = run_threads(body, 3)
    if results[0] == "no single copy here":
        pytest.skip("process_vm_readv is not usable here")
    name, done = results[1]
    assert name == "RuntimeError" and all(done), results
    assert {r[0] for r in results[::2]} == {"AbortedError"}, results
