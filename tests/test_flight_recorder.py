"""The flight recorder (chorus.debug.flight): what a group's ring holds, its size setting,
dumps on request, on errors and on signals; and the three failures a job can die of —
a stalled rank, a mismatched call, a killed rank — in 4 real processes, read back by
``chorus analyze``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from proc_support import REPO, reserved_port, wait_until

import chorus as dist
from chorus import config
from chorus.api.state import current
from chorus.debug import dump_flight_recorder, flight
from chorus.debug.analyze import analyze
from chorus.errors import CollectiveMismatchError
from chorus.testing import run_threads


def _entries(path: str, group: int = 0) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    return next(g for g in data["groups"] if g["id"] == group)["entries"]


def test_the_ring_holds_every_op_with_its_call_component_state_and_times(tmp_path):
    def body(rank, world):
        a = np.ones(4, np.float32)
        dist.all_reduce(a)  # the latency lane
        dist.all_gather_into_tensor(np.zeros(8, np.float32), a)
        dist.all_reduce(a, op=dist.ReduceOp.MAX, async_op=True).wait()
        dist.broadcast(np.arange(3), src=1)
        dist.barrier()
        return dump_flight_recorder(str(tmp_path / f"rank{rank}.json"), rank=rank)

    run_threads(body, 2)
    entries = _entries(str(tmp_path / "rank1.json"))
    assert [e["seq"] for e in entries] == [0, 1, 2, 3, 4]
    assert [e["op"] for e in entries] == ["all_reduce", "all_gather", "all_reduce", "broadcast", "barrier"]
    assert [e["lane"] for e in entries] == [True, False, False, False, False]
    assert all(e["state"] == "done" and e["component"] == "shm" for e in entries)
    first, gather, mx, bcast, _ = entries
    assert (first["dtype"], first["count"], first["nbytes"], first["reduce_op"]) == ("float32", 4, 16, "SUM")
    assert first["call"] == "all_reduce(float32, count=4, op=SUM)"
    assert gather["count"] == 4 and gather["reduce_op"] == ""
    assert mx["reduce_op"] == "MAX" and mx["async"] is True
    assert bcast["root"] == 1 and bcast["dtype"] == "int64"
    for e in entries:
        assert e["issued"] <= e["started"] and (e["ended"] is None or e["started"] <= e["ended"])
    assert gather["ended"] is not None and gather["error"] is None and gather["waiting_on"] == []


def test_the_ring_keeps_the_last_n_ops():
    def body(rank, world):
        a = np.ones(1, np.float32)
        for _ in range(13):
            dist.all_reduce(a)
        for _ in range(4):
            dist.all_reduce(np.ones(2, np.int64), async_op=True).wait()
        ring = current().default_group.flight
        return [e["seq"] for e in ring.entries()]

    with config.override(CHORUS_FLIGHT_RECORDER_SIZE=8):
        seqs = run_threads(body, 2)
    assert seqs == [list(range(9, 17))] * 2


def test_a_long_run_is_cut_back_to_the_last_n_ops_with_their_plans():
    """Past a lap (size + flight.MAX_STEP ops) the lanes' lists are trimmed; every op kept
    still has its own plan (dtype) although the plans alternate."""
    def body(rank, world):
        arrays = [np.ones(1, np.float32), np.ones(1, np.float64), np.ones(3, np.int32)]
        for i in range(2500):
            dist.all_reduce(arrays[i % 3], op=dist.ReduceOp.MAX)
            if i % 97 == 0:
                dist.all_gather_into_tensor(np.zeros(world, np.float32), arrays[0])
        ring = current().default_group.flight
        return [(e["seq"], e["dtype"], e["lane"]) for e in ring.entries()], len(ring.lanes[0]), len(ring.keys[0])

    with config.override(CHORUS_FLIGHT_RECORDER_SIZE=40):
        entries, kept, keys = run_threads(body, 2)[0]
    assert [e[0] for e in entries] == list(range(2526 - 40, 2526))  # 2500 all_reduces, 26 all_gathers
    lane = [e for e in entries if e[2]]
    dtypes = {"float32": 0, "float64": 1, "int32": 2}
    # all_reduce i is op i + (all_gathers before it), one after every 97th all_reduce
    index_of = {i + len(range(0, i, 97)): i for i in range(2500)}
    assert lane and all(dtypes[dtype] == index_of[seq] % 3 for seq, dtype, _ in lane)
    assert kept <= 40 + flight.MAX_STEP and keys <= kept + 1


def test_size_0_turns_it_off():
    def body(rank, world):
        dist.all_reduce(np.ones(1, np.float32))
        dist.all_gather_into_tensor(np.zeros(2, np.float32), np.ones(1, np.float32))
        pg = current().default_group
        return pg.flight, pg.lane.flight

    with config.override(CHORUS_FLIGHT_RECORDER_SIZE=0):
        assert run_threads(body, 2) == [(None, None)] * 2


def test_a_queued_op_shows_as_queued_while_the_one_before_runs(tmp_path):
    def body(rank, world):
        a = np.ones(4, np.float32)
        if rank == 0:
            time.sleep(0.3)  # rank 1's first op waits for rank 0; its second is queued
        w1 = dist.all_reduce(a, async_op=True)
        w2 = dist.all_reduce(np.ones(2, np.float32), async_op=True)
        seen = None
        if rank == 1:
            seen = [e["state"] for e in current().default_group.flight.entries()]
        w1.wait()
        w2.wait()
        return seen

    states = run_threads(body, 2)[1]
    assert states[1] == "queued" and states[0] in ("queued", "started")


def test_an_error_dumps_every_rank_into_the_directory(tmp_path):
    def body(rank, world):
        a = np.ones(4, np.float32)
        dist.all_reduce(a)
        if rank == 0:
            dist.all_gather_into_tensor(np.zeros(8, np.float32), a)
        else:
            dist.all_reduce(a)

    with config.override(CHORUS_FLIGHT_RECORDER_DIR=str(tmp_path)):
        results = run_threads(body, 2, return_exceptions=True)
    assert all(isinstance(r, CollectiveMismatchError) for r in results)
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as f:
            data = json.load(f)
        assert data["rank"] == rank and data["reason"].startswith("CollectiveMismatchError")
        last = data["groups"][0]["entries"][-1]
        assert last["seq"] == 1 and last["state"] == "failed"
        assert last["op"] == ("all_gather" if rank == 0 else "all_reduce")
    report = analyze(str(tmp_path))
    assert [f.kind for f in report.findings][:1] == ["mismatch"]


def test_dump_needs_a_path_or_the_directory(monkeypatch):
    monkeypatch.delenv("CHORUS_FLIGHT_RECORDER_DIR", raising=False)

    def body(rank, world):
        dist.barrier()
        with pytest.raises(ValueError, match="CHORUS_FLIGHT_RECORDER_DIR"):
            dump_flight_recorder(rank=rank)

    run_threads(body, 1)


# -- 4 real processes ----------------------------------------------------------------------

WORKER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import chorus as dist

    rank = int(os.environ["RANK"])
    scenario, out = os.environ["SCENARIO"], os.environ["OUT"]
    dist.init_process_group("chorus", timeout=6.0)
    t = np.ones(4, np.float32)
    start = time.monotonic()
    try:
        for i in range(8):
            if i == 5 and rank == 2 and scenario == "stall":
                time.sleep(120)
            if i == 5 and rank == 2 and scenario == "kill":
                os.kill(os.getpid(), 9)
            if i == 5 and rank == 1 and scenario == "mismatch":
                dist.all_gather_into_tensor(np.zeros(16, np.float32), t)
            else:
                dist.all_reduce(t)
        result = {"ok": True}
    except Exception as exc:
        result = {"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    with open(os.path.join(out, f"outcome{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(1 if "error" in result else 0)
""")


def _job(tmp_path, scenario: str):
    """Start the 4 ranks of ``scenario``; return (their Popens, the dump directory)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    dumps = tmp_path / "fr"
    env = dict(os.environ, SCENARIO=scenario, OUT=str(tmp_path), CHORUS_FLIGHT_RECORDER_DIR=str(dumps),
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
               MASTER_ADDR="127.0.0.1", WORLD_SIZE="4")
    with reserved_port() as port:
        procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, MASTER_PORT=str(port), RANK=str(r)),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for r in range(4)]
    return procs, str(dumps)


def _outcomes(tmp_path, ranks) -> dict[int, dict]:
    out = {}
    for r in ranks:
        with open(tmp_path / f"outcome{r}.json") as f:
            out[r] = json.load(f)
    return out


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stderr.close()


def test_a_stalled_rank_is_named_behind_at_the_all_reduce_it_never_joined(tmp_path, job):
    procs, dumps = _job(tmp_path, "stall")
    try:
        started = time.monotonic()
        others = [procs[r] for r in (0, 1, 3)]
        assert wait_until(lambda: all(p.poll() is not None for p in others), 40)
        outcomes = _outcomes(tmp_path, (0, 1, 3))
        assert all(o["error"] == "CommTimeoutError" and o["elapsed"] < 15 for o in outcomes.values()), outcomes
        assert time.monotonic() - started < 40
        assert procs[2].poll() is None  # still stalled: a launcher stops it
        procs[2].send_signal(signal.SIGTERM)
        procs[2].wait(10)
        assert procs[2].returncode == -signal.SIGTERM  # it dumped, then died of the signal as before
    finally:
        _stop(procs)
    assert sorted(os.listdir(dumps)) == [f"rank{r}.json" for r in range(4)]
    report = analyze(dumps)
    behind = [f for f in report.findings if f.kind == "behind"]
    assert len(behind) == 1 and behind[0].ranks == [2] and behind[0].seq == 5
    assert "all_reduce" in behind[0].text and "rank 2" in behind[0].text
    assert "WAITING: ranks 0, 1, 3 in op #5 all_reduce" in report.text and "waiting for rank 2" in report.text
    assert report.text.rstrip().splitlines()[-2].startswith("diagnosis: group WORLD (id 0): rank 2 is behind")


def test_a_mismatched_rank_is_shown_side_by_side(tmp_path, job):
    procs, dumps = _job(tmp_path, "mismatch")
    try:
        assert wait_until(lambda: all(p.poll() is not None for p in procs), 30)
    finally:
        _stop(procs)
    outcomes = _outcomes(tmp_path, range(4))
    assert all(o["error"] == "CollectiveMismatchError" and o["elapsed"] < 15 for o in outcomes.values())
    assert len(os.listdir(dumps)) >= 3
    report = analyze(dumps)
    first = report.findings[0]
    assert first.kind == "mismatch" and first.seq == 5 and first.ranks == [1]
    assert "ranks 0, 2, 3    all_reduce(float32, count=4, op=SUM)" in report.text
    assert "rank 1           all_gather(float32, count=4)" in report.text
    assert "#5  all_reduce(float32,4) failed  all_gather(float32,4) failed" in report.text


def test_a_killed_rank_is_named_with_what_its_peers_last_saw(tmp_path, job):
    procs, dumps = _job(tmp_path, "kill")
    try:
        assert wait_until(lambda: all(p.poll() is not None for p in procs), 30)
    finally:
        _stop(procs)
    assert procs[2].returncode == -signal.SIGKILL
    outcomes = _outcomes(tmp_path, (0, 1, 3))
    assert all(o["error"] == "PeerLostError" and o["elapsed"] < 15 for o in outcomes.values()), outcomes
    assert sorted(os.listdir(dumps)) == ["rank0.json", "rank1.json", "rank3.json"]
    report = analyze(dumps)
    lost = [f for f in report.findings if f.kind == "no_dump"]
    assert lost and lost[0].ranks == [2] and lost[0].seq == 5
    assert "its peers last completed op #4 all_reduce" in lost[0].text
    assert "rank 2 was lost" in report.text
    code = subprocess.run([sys.executable, "-m", "chorus.cli", "analyze", dumps], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO)).returncode
    assert code == 1
