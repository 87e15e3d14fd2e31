"""A large all_reduce over TCP in parts, each on its own channel (chorus.components.channels):
real processes over TCP, channels forced on with small parts so that the data stays small."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from proc_support import reserved_port

import chorus as dist
from chorus.components.channels import Channels, GroupChannels, agreed
from chorus.testing import run_processes

PART = 64 << 10  # CHORUS_TCP_CHANNEL_BYTES here: every size above the TCP lane's (CHORUS_TCP_LANE_BYTES)


@pytest.fixture
def channels_env(monkeypatch):
    monkeypatch.setenv("CHORUS_TRANSPORT", "tcp")
    monkeypatch.setenv("CHORUS_TCP_CHANNEL_BYTES", str(PART))


def _split():
    return dist.group.WORLD.components[0].channels


def _counting_runs():
    """Count GroupChannels.run calls in this process: {"runs": n}."""
    seen = {"runs": 0}
    original = GroupChannels.run

    def run(self, ctx, count, total, run_part):
        seen["runs"] += 1
        return original(self, ctx, count, total, run_part)

    GroupChannels.run = run
    return seen


def _values(rank, n, dtype):
    rng = np.random.default_rng(1000 * rank + n)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-1000, 1000, n).astype(dtype)


def _split_body(rank, world):
    seen = _counting_runs()
    out = {}
    small = np.ones(10, np.float32)
    dist.all_reduce(small)  # the TCP lane's
    lane = np.ones(PART // 4, np.float32)
    dist.all_reduce(lane)  # no larger than the lane's bytes: never split
    out["small"] = bool((small == world).all() and (lane == world).all())
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
    z = np.full(3 * PART // 4, rank + 1, np.float32)
    dist.all_reduce(z, op=dist.ReduceOp.AVG)  # the hooks around the parts run once
    out["avg"] = bool(np.allclose(z, (world + 1) / 2))
    return _split().channels.count, seen["runs"], out, digests


def test_a_large_all_reduce_runs_in_parts_on_every_channel_with_the_same_bits_everywhere(channels_env, monkeypatch):
    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "3")
    results = run_processes(_split_body, 3)
    for count, runs, out, _ in results:
        assert count == 3
        assert runs == 14  # every all_reduce larger than the lane's
        assert all(out.values()), out
    assert results[0][3] == results[1][3] == results[2][3]  # bit-identical on every rank


@pytest.mark.parametrize("count, nbytes, parts", [
    (4, (4 << 20) - 1, 1), (4, 4 << 20, 2), (4, 8 << 20, 2), (4, 12 << 20, 3), (4, 64 << 20, 4),
    (2, 64 << 20, 2), (3, 5 << 20, 2),
])
def test_parts_by_size_and_count(count, nbytes, parts):
    assert Channels([], count, 4 << 20, 64 << 10).parts(nbytes) == parts


def test_a_size_a_tcp_lane_may_take_is_never_split():
    assert Channels([], 4, 64 << 10, 1 << 20).parts(1 << 20) == 1
    assert Channels([], 4, 64 << 10, 1 << 20).parts((1 << 20) + 4) == 4


def _entry(asked=0, cpus=16, host="a", local=99, nbytes=4 << 20, lane=64 << 10, tcp=True):
    return {"asked": asked, "cpus": cpus, "host": host, "local": local, "bytes": nbytes, "lane": lane, "tcp": tcp}


@pytest.mark.parametrize("table, want", [
    ([_entry()] * 2, (4, 4 << 20, 64 << 10)),  # 16 CPUs for 2 ranks on the host: at most 4
    ([_entry()] * 8, (2, 4 << 20, 64 << 10)),  # 16 for 8
    ([_entry()] * 16, (1, 4 << 20, 64 << 10)),  # none to spare
    ([_entry(host="a"), _entry(host="b")] * 8, (2, 4 << 20, 64 << 10)),  # two hosts of 8 ranks
    ([_entry(host="a", cpus=2), _entry(host="b")], (2, 4 << 20, 64 << 10)),  # one per host: 2 and 16 CPUs
    ([_entry(asked=1), _entry(asked=4)], (1, 4 << 20, 64 << 10)),  # one rank asks for none
    ([_entry(asked=3), _entry()], (3, 4 << 20, 64 << 10)),
    ([_entry(host="", local=4), _entry(host="", local=4)], (4, 4 << 20, 64 << 10)),  # no host: LOCAL_WORLD_SIZE
    ([_entry(nbytes=1 << 20, lane=1 << 20), _entry(nbytes=8 << 20)], (4, 8 << 20, 1 << 20)),
    ([_entry(tcp=False)] * 2, (1, 4 << 20, 64 << 10)),  # one host, shared memory: no TCP group
    ([_entry(tcp=False), _entry(tcp=True)], (4, 4 << 20, 64 << 10)),  # one rank over TCP only
    ([_entry(host="a", tcp=False), _entry(host="b", tcp=False)], (4, 4 << 20, 64 << 10)),  # two hosts
    ([_entry(host=str(h)) for h in range(200)], (2, 4 << 20, 64 << 10)),  # at most 256 more sockets a rank
    ([_entry(host=str(h), asked=4) for h in range(200)], (4, 4 << 20, 64 << 10)),  # unless asked
])
def test_every_rank_reads_the_same_table_and_agrees(table, want):
    assert agreed(table) == want


_LAUNCH_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, chorus as dist
    dist.init_process_group("gloo")
    x = np.ones(1 << 16, np.float32)
    dist.all_reduce(x)
    channels = dist.group.WORLD.components[0].channels
    print(channels.channels.count if channels else 1, float(x[0]))
    dist.destroy_process_group()
""")


def _launch(tmp_path, script, envs, timeout=60, check=True):
    """Run ``script`` as ranks with per-rank environments ``envs``: each rank's stdout
    (``check`` False: each rank's (exit status, stdout, stderr))."""
    path = tmp_path / "job.py"
    path.write_text(script)
    with reserved_port() as port:
        procs = [subprocess.Popen([sys.executable, str(path), str(tmp_path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                           RANK=str(rank), WORLD_SIZE=str(len(envs)), CHORUS_TOKEN="channels",
                                           CHORUS_TRANSPORT="tcp", **env))
                 for rank, env in enumerate(envs)]
        try:
            outs = [p.communicate(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                p.kill()
                p.communicate()
    if not check:
        return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    return [out for out, _ in outs]


def test_ranks_asking_for_different_counts_use_the_least_and_one_means_none(tmp_path):
    small = {"CHORUS_TCP_CHANNEL_BYTES": str(PART)}
    assert _launch(tmp_path, _LAUNCH_SCRIPT, [dict(small, CHORUS_TCP_CHANNELS="4"),
                                              dict(small, CHORUS_TCP_CHANNELS="2")]) == ["2 2.0\n"] * 2
    assert _launch(tmp_path, _LAUNCH_SCRIPT, [dict(small, CHORUS_TCP_CHANNELS="1"),
                                              dict(small, CHORUS_TCP_CHANNELS="3")]) == ["1 2.0\n"] * 2


def test_ranks_with_different_channel_and_lane_bytes_split_alike(tmp_path):
    """Rank 1's lane takes the 256 KiB all_reduce; rank 0, whose lane is 64 KiB, must not split it."""
    envs = [{"CHORUS_TCP_CHANNELS": "2", "CHORUS_TCP_CHANNEL_BYTES": str(PART)},
            {"CHORUS_TCP_CHANNELS": "2", "CHORUS_TCP_CHANNEL_BYTES": str(PART // 2),
             "CHORUS_TCP_LANE_BYTES": str(4 * PART)}]
    assert _launch(tmp_path, _LAUNCH_SCRIPT, envs) == ["2 2.0\n"] * 2


@pytest.mark.parametrize("bad", [0, 1])
def test_a_setting_out_of_range_on_one_rank_fails_every_rank_at_start(tmp_path, bad):
    start = time.monotonic()
    envs = [{}, {}]
    envs[bad] = {"CHORUS_TCP_CHANNELS": "9"}
    results = _launch(tmp_path, _LAUNCH_SCRIPT, envs, check=False)
    assert time.monotonic() - start < 20
    for code, _, err in results:
        assert code != 0
        assert f"rank {bad}: CHORUS_TCP_CHANNELS" in err, err[-2000:]


def test_a_segment_set_on_one_rank_only_fails_every_rank_at_start(tmp_path):
    """Set to the default value, but on one rank: the ring's pieces could differ (a ring of
    16 ranks sends whole chunks where it is unset), so every rank's start fails naming both."""
    results = _launch(tmp_path, _LAUNCH_SCRIPT, [{}, {"CHORUS_SEGMENT_BYTES": str(1 << 20)}], check=False)
    for code, _, err in results:
        assert code != 0
        assert "CHORUS_SEGMENT_BYTES differs among the ranks (rank 0: unset, rank 1: 1048576)" in err, err[-2000:]


def test_equal_segments_agree():
    from chorus.components.channels import segments_differ

    assert segments_differ([{"segment": 0}, {"segment": 0}]) == []
    assert segments_differ([{"segment": 4096}, {"segment": 4096}]) == []
    assert segments_differ([{"segment": 4096}, {"segment": 0}]) != []


def _all_reduce_expecting_mismatch(x):
    """(error's type name or "no error", seconds the all_reduce of ``x`` took, message)."""
    start = time.monotonic()
    try:
        dist.all_reduce(x)
    except dist.CollectiveMismatchError as exc:
        return type(exc).__name__, time.monotonic() - start, str(exc)
    return "no error", time.monotonic() - start, ""


def _mismatch_body(rank, world):
    return _all_reduce_expecting_mismatch(np.ones((4 if rank == 0 else 6) * PART // 4, np.float32))


def test_a_mismatch_between_split_all_reduces_is_named_on_every_rank(channels_env, monkeypatch):
    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "2")
    for name, seconds, message in run_processes(_mismatch_body, 2, op_timeout=30):
        assert name == "CollectiveMismatchError", message
        assert seconds < 10
        assert "all_reduce" in message


def _split_against_lane_body(rank, world):
    y = np.ones(4 * PART // 4 if rank == 0 else 10, np.float32)  # split on rank 0, the lane's on rank 1
    start = time.monotonic()
    try:
        dist.all_reduce(y)
    except dist.CollectiveMismatchError as exc:
        took = time.monotonic() - start
        if rank == 1:
            time.sleep(5)  # still here: rank 0's parts on the channels must not wait for it to leave
        return type(exc).__name__, took
    return "no error", time.monotonic() - start


def test_a_split_all_reduce_against_another_call_fails_at_once_on_every_rank(channels_env, monkeypatch):
    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "2")
    for name, seconds in run_processes(_split_against_lane_body, 2, op_timeout=30):
        assert name == "CollectiveMismatchError"
        assert seconds < 3


def _two_groups_body(rank, world):
    g1, g2 = dist.new_group([0, 1]), dist.new_group([0, 1])
    a, b = np.full(4 * PART // 4, 1.0, np.float32), np.full(4 * PART // 4, 2.0, np.float32)
    first, second = (g1, a), (g2, b)
    if rank == 1:
        first, second = second, first
    work = dist.all_reduce(first[1], group=first[0], async_op=True)
    dist.all_reduce(second[1], group=second[0])
    work.wait()
    return float(a[0]), float(b[0])


def test_two_groups_split_at_once_in_opposite_orders(channels_env, monkeypatch):
    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "2")
    assert run_processes(_two_groups_body, 2, op_timeout=30) == [(2.0, 4.0)] * 2


def _close_body(rank, world):
    g = dist.new_group([0, 1])
    x = np.ones(4 * PART // 4, np.float32)
    dist.all_reduce(x, group=g)
    names = lambda: sorted(t.name for t in threading.enumerate() if t.name.startswith("chorus-"))  # noqa: E731
    during = [n for n in names() if "channel" in n]
    dist.destroy_process_group(g)
    deadline = time.monotonic() + 5
    while any("channel" in n for n in names()) and time.monotonic() < deadline:
        time.sleep(0.01)
    after_group = [n for n in names() if "channel" in n]
    dist.destroy_process_group()
    while names() and time.monotonic() < deadline + 5:
        time.sleep(0.01)
    return float(x[0]), during, after_group, names()


def test_destroying_a_group_stops_its_threads_and_leaving_closes_the_channels(channels_env, monkeypatch):
    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "2")
    for value, during, after_group, after_world in run_processes(_close_body, 2):
        assert (value, len(during), after_group, after_world) == (2.0, 1, [], [])


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


def _traced_split_body(rank, world):
    from chorus import recorder
    from chorus.trace import chrome_events

    events = []
    recorder.attach(events.append)
    try:
        x = np.ones(2 * PART // 4, np.float32)  # two parts, one per channel
        dist.all_reduce(x)
    finally:
        recorder.detach()
    return chrome_events(events, rank), bool((x == world).all())


def test_a_split_all_reduce_traces_each_channel_on_its_own_track_and_replays(channels_env, monkeypatch, tmp_path):
    """In a trace (chorus.trace) each part's transfers go on a track "group 0 channel K",
    naming their group and channel; chorus explain --trace replays the op from part 0's."""
    import json

    from chorus.explain.replay import replay

    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "2")
    results = run_processes(_traced_split_body, 2)
    assert all(ok for _, ok in results)
    events = [e for evs, _ in results for e in evs]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    moved = [e for e in events if e.get("cat") == "transfer"]
    assert moved and all(e["args"]["group"] == 0 for e in moved)
    for rank in (0, 1):
        tracks = {e["args"]["channel"]: names[(rank, e["tid"])] for e in moved if e["pid"] == rank}
        assert tracks == {0: "group 0 channel 0", 1: "group 0 channel 1"}, tracks
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"world_size": 2}}))
    walk, listing = replay(str(path))
    assert any("split into 2 parts" in line for line in walk.footer), walk.footer
    assert walk.count == PART // 4  # part 0's slice: half of the 2 * PART bytes, in float32
    assert any("the traced transfers are the schedule's" in line for line in walk.footer), walk.footer


def _hosts_ring_body(rank, world):
    from chorus import recorder

    seen = _counting_runs()
    begun = []
    recorder.attach(lambda e: begun.append((e.component, e.algorithm, e.detail.get("channels", 1)))
                    if e.what == "begin" and e.group == 0 else None)
    results = {}
    for n in (4 * PART // 4, 4 * PART // 4 + 13):  # the ring in parts (2 on 2 channels)
        x = np.arange(n, dtype=np.int64) * (rank + 1)
        dist.all_reduce(x)
        results[n] = x.tobytes()
    y = np.arange(PART // 16, dtype=np.int64) * (rank + 1)  # under the ring's size: the phases
    dist.all_reduce(y)
    results["phases"] = y.tobytes()
    z = np.arange(4 * PART // 4, dtype=np.int64) * (rank + 1)
    dist.all_reduce(z, algorithm="ring")  # a flat algorithm forced: whole, not in parts
    results["flat"] = z.tobytes()
    recorder.detach()
    return seen["runs"], begun, results


def test_two_hosts_of_two_run_the_large_ring_in_parts_on_the_channels(monkeypatch):
    """Hosts a, a, b, b: an all_reduce from CHORUS_HIER_RING_BYTES runs the ring through the
    hosts, and from CHORUS_TCP_CHANNEL_BYTES in parts, part 0 over the group's transport
    (its hops inside a host through shared memory), part 1 over channel 1, with every
    rank's exact sum; a smaller one keeps the phases, and a flat algorithm forced on the
    group runs whole."""
    monkeypatch.setenv("CHORUS_HOST_ID", "a,a,b,b")
    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "2")
    monkeypatch.setenv("CHORUS_TCP_CHANNEL_BYTES", str(PART))
    monkeypatch.setenv("CHORUS_HIER_RING_BYTES", str(PART))
    world = 4
    for runs, begun, results in run_processes(_hosts_ring_body, world, op_timeout=30):
        assert runs == 2
        assert begun == [("hierarchical", "ring", 2), ("hierarchical", "ring", 2),
                         ("hierarchical", "hierarchical", 1), ("tcp", "ring", 1)], begun
        for n in (4 * PART // 4, 4 * PART // 4 + 13):
            assert results[n] == (np.arange(n, dtype=np.int64) * 10).tobytes(), n
        assert results["phases"] == (np.arange(PART // 16, dtype=np.int64) * 10).tobytes()
        assert results["flat"] == (np.arange(4 * PART // 4, dtype=np.int64) * 10).tobytes()


def _hosts_ring_mismatch_body(rank, world):
    x = np.ones(4 * PART // 4 if rank in (0, 3) else PART // 16, np.float32)  # ring in parts on 0 and 3
    dist.barrier()
    return _all_reduce_expecting_mismatch(x)


def test_two_hosts_of_two_a_split_ring_against_the_phases_fails_at_once_on_every_rank(monkeypatch):
    """Ranks 0 and 3 run an all_reduce as the ring in parts, ranks 1 and 2 a smaller one in
    phases on the sub-groups: every rank raises CollectiveMismatchError within seconds."""
    monkeypatch.setenv("CHORUS_HOST_ID", "a,a,b,b")
    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "2")
    monkeypatch.setenv("CHORUS_TCP_CHANNEL_BYTES", str(PART))
    monkeypatch.setenv("CHORUS_HIER_RING_BYTES", str(PART))
    for name, seconds, message in run_processes(_hosts_ring_mismatch_body, 4, op_timeout=30):
        assert name == "CollectiveMismatchError", message
        assert seconds < 10, seconds
        assert "all_reduce" in message


def _hosts_ring_destroy_body(rank, world):
    g = dist.new_group([0, 1, 2, 3])
    x = np.ones(4 * PART // 4, np.float32)
    dist.all_reduce(x, group=g)  # the ring in parts: group g's channel thread starts
    dist.all_reduce(x)
    names = lambda: sorted(t.name for t in threading.enumerate() if "channel" in t.name)  # noqa: E731
    during = names()
    dist.destroy_process_group(g)
    deadline = time.monotonic() + 5
    while len(names()) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    after_group = names()
    dist.destroy_process_group()
    while names() and time.monotonic() < deadline + 5:
        time.sleep(0.01)
    return float(x[0]), during, after_group, names()


def test_two_hosts_of_two_destroying_a_group_stops_its_ring_s_channel_threads(monkeypatch):
    monkeypatch.setenv("CHORUS_HOST_ID", "a,a,b,b")
    monkeypatch.setenv("CHORUS_TCP_CHANNELS", "2")
    monkeypatch.setenv("CHORUS_TCP_CHANNEL_BYTES", str(PART))
    monkeypatch.setenv("CHORUS_HIER_RING_BYTES", str(PART))
    for value, during, after_group, after_world in run_processes(_hosts_ring_destroy_body, 4, op_timeout=30):
        assert value == 16.0  # two all_reduces of ones over four ranks
        assert during == ["chorus-group0-channel1_0", "chorus-group1-channel1_0"], during
        assert after_group == ["chorus-group0-channel1_0"], after_group
        assert after_world == [], after_world
