"""A large all_reduce over TCP in parts, each on its own channel (chorus.components.channels):
real processes over TCP, channels forced on with small parts so that the data stays small."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from proc_support import reserved_port

import chorus as dist
from chorus import config
from chorus.components.channels import Channels
from chorus.store import HashStore
from chorus.testing import run_processes

PART = 64 << 10  # CHORUS_TCP_CHANNEL_BYTES here: every size above the TCP lane's (CHORUS_TCP_LANE_BYTES)


@pytest.fixture
def channels_env(monkeypatch):
    monkeypatch.setenv("CHORUS_TRANSPORT", "tcp")
    monkeypatch.setenv("CHORUS_TCP_CHANNEL_BYTES", str(PART))


def _channels():
    return dist.group.WORLD.components[0].channels


def _counting_runs():
    """Count Channels.run calls in this process: {"runs": n}."""
    seen = {"runs": 0}
    original = Channels.run

    def run(self, count, total, run_part):
        seen["runs"] += 1
        return original(self, count, total, run_part)

    Channels.run = run
    return seen


def _values(rank, n, dtype):
    rng = np.random.default_rng(1000 * rank + n)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def _split_body(rank, world):
    seen = _counting_runs()
    ch = _channels()
    before_open = ch.count
    small = np.ones(10, np.float32)
    dist.all_reduce(small)  # too small to be split: nothing opens
    after_small = ch.count
    out = {"small": bool((small == world).all())}
    first = np.full(2 * PART // 4, rank + 1, np.float32)
    dist.all_reduce(first)  # the first large enough: runs unsplit, then the channels open
    out["first"] = bool((first == world * (world + 1) / 2).all())
    digests = {}
    for dtype, op in (("float32", dist.ReduceOp.SUM), ("float64", dist.ReduceOp.MAX),
                      ("int64", dist.ReduceOp.SUM), ("float16", dist.ReduceOp.SUM)):
        for n in (2 * PART // np.dtype(dtype).itemsize, 3 * PART // np.dtype(dtype).itemsize + 7, 100_003):
            x = _values(rank, n, dtype)
            dist.all_reduce(x, op=op)
            every = [_values(r, n, dtype).astype(np.float64) for r in range(world)]
            want = np.max(every, axis=0) if op == dist.ReduceOp.MAX else np.sum(every, axis=0)
            tol = 0 if dtype in ("int64", "float64") else (5e-2 if dtype == "float16" else 1e-5)
            out[(dtype, n)] = bool(np.allclose(x.astype(np.float64), want, rtol=tol, atol=tol))
            digests[(dtype, n)] = x.tobytes()
    y = np.full(5 * PART // 4, rank, np.int32)
    dist.all_reduce(y, async_op=True).wait()
    out["async"] = bool((y == world * (world - 1) // 2).all())
    return before_open, after_small, ch.count, seen["runs"], out, digests


def test_a_large_all_reduce_runs_in_parts_on_every_channel_with_the_same_bits_everywhere(channels_env, monkeypatch):
    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "3")
    results = run_processes(_split_body, 3)
    for before_open, after_small, count, runs, out, _ in results:
        assert (before_open, after_small, count) == (None, None, 3)
        assert runs == 13  # every all_reduce after the channels opened
        assert all(out.values()), out
    assert results[0][5] == results[1][5] == results[2][5]  # bit-identical on every rank


@pytest.mark.parametrize("count, nbytes, parts", [
    (None, 64 << 20, 1),  # not open yet
    (4, (4 << 20) - 1, 1), (4, 4 << 20, 2), (4, 8 << 20, 2), (4, 12 << 20, 3), (4, 64 << 20, 4),
    (2, 64 << 20, 2), (3, 5 << 20, 2),
])
def test_parts_by_size_and_count(count, nbytes, parts):
    ch = Channels(SimpleNamespace(id=7), store=HashStore())
    ch.min_bytes, ch.count = 4 << 20, count
    assert ch.parts(nbytes) == parts


def _least_body(rank, world):
    with config.override(CHORUS_TCP_CHANNELS=4 if rank == 0 else 2):
        x = np.full(8 * PART // 4, 1.0, np.float32)
        dist.all_reduce(x)  # opens them
        dist.all_reduce(x)
    return _channels().count, bool((x == world * world).all())


def test_members_asking_for_different_counts_use_the_least(channels_env):
    assert run_processes(_least_body, 2) == [(2, True), (2, True)]


def test_one_channel_asked_means_none(channels_env, monkeypatch):
    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "1")
    assert run_processes(_channels_of_world, 2) == [False, False]


def _channels_of_world(rank, world):
    return _channels() is not None


def _mismatch_body(rank, world):
    x = np.ones(4 * PART // 4, np.float32)
    dist.all_reduce(x)  # opens them
    y = np.ones((4 if rank == 0 else 6) * PART // 4, np.float32)
    start = time.monotonic()
    try:
        dist.all_reduce(y)
    except dist.CollectiveMismatchError as exc:
        return type(exc).__name__, time.monotonic() - start, str(exc)
    return "no error", time.monotonic() - start, ""


def test_a_mismatch_after_the_channels_open_is_named_on_every_rank(channels_env, monkeypatch):
    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "2")
    for name, seconds, message in run_processes(_mismatch_body, 2, op_timeout=30):
        assert name == "CollectiveMismatchError", message
        assert seconds < 10
        assert "all_reduce" in message


def _close_body(rank, world):
    g = dist.new_group([0, 1])
    x = np.ones(4 * PART // 4, np.float32)
    dist.all_reduce(x, group=g)
    dist.all_reduce(x, group=g)
    opened = g.components[0].channels.count
    channel_threads = lambda: [t.name for t in threading.enumerate() if "channel" in t.name]  # noqa: E731
    during = channel_threads()
    dist.destroy_process_group(g)
    deadline = time.monotonic() + 5
    while channel_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return opened, len(during), channel_threads(), float(x[0])


def test_destroying_the_group_closes_its_channels(channels_env, monkeypatch):
    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "2")
    for opened, during, after, value in run_processes(_close_body, 2):
        assert (opened, during, after, value) == (2, 1, [], 4.0)


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, numpy as np, chorus as dist
    outdir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = np.ones(1 << 20, np.float32)  # 4 MiB: 4 parts of 1 MiB (CHORUS_TCP_CHANNEL_BYTES=1 MiB)
    dist.all_reduce(x)  # opens the channels
    dist.all_reduce(x)
    open(f"{outdir}/ready{rank}", "w").close()
    if rank == 1:
        while len([f for f in os.listdir(outdir) if f.startswith("ready")]) < 3:
            time.sleep(0.01)
        open(f"{outdir}/killed", "w").write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            dist.all_reduce(x)
    except Exception as exc:
        open(f"{outdir}/rank{rank}", "w").write(f"{time.time()!r}\\n{type(exc).__name__}: {exc}")
        sys.exit(3)
""")


def test_a_rank_killed_during_split_all_reduces_fails_every_survivor_with_peer_lost(tmp_path):
    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT)
    with reserved_port() as port:
        procs = []
        for rank in range(3):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="3",
                       CHORUS_TOKEN="channels-kill", CHORUS_TRANSPORT="tcp", CHORUS_TCP_CHANNELS="4",
                       CHORUS_TCP_CHANNEL_BYTES=str(1 << 20))
            procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env))
        try:
            errs = {rank: procs[rank].communicate(timeout=60)[1] for rank in (0, 2)}
        finally:
            for p in procs:
                p.kill()
                p.communicate()
    assert procs[1].returncode == -signal.SIGKILL
    killed_at = float((tmp_path / "killed").read_text())
    for rank in (0, 2):
        assert procs[rank].returncode == 3, errs[rank][-2000:]
        when, message = (tmp_path / f"rank{rank}").read_text().split("\n", 1)
        assert message.startswith("PeerLostError") and "rank 1" in message, message
        assert float(when) - killed_at < 5.0
