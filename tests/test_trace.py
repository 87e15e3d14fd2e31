"""CHORUS_TRACE (chorus.trace): Chrome-trace files per rank with op spans and, inside them,
the transfers the components report; clock offsets; ``chorus trace merge``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from proc_support import REPO

from chorus.recorder import Event
from chorus.store import HashStore
from chorus.trace import chrome_events, measure_offset, merge

JOB = textwrap.dedent("""
    import numpy as np
    import chorus as dist
    dist.init_process_group("chorus", timeout=30)
    a = np.ones(1000, np.float32)
    for _ in range(3):
        dist.all_reduce(a)
        dist.all_gather_into_tensor(np.zeros(2000, np.float32), a)
    dist.destroy_process_group()
""")


def _traced_job(tmp_path, transport: str) -> str:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    prefix = str(tmp_path / transport)
    env = dict(os.environ, CHORUS_TRACE=prefix, CHORUS_TRANSPORT=transport, PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, "-m", "chorus.run", "--nproc-per-node", "2", "--master-port", "0", str(script)],
                         capture_output=True, text=True, env=env, timeout=90)
    assert run.returncode == 0, run.stderr
    return prefix


def _spans(path: str):
    with open(path) as f:
        doc = json.load(f)  # valid JSON
    assert isinstance(doc["traceEvents"], list) and doc["otherData"]["chorus_trace"] == 1
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], float) and e["name"]
    ops = [e for e in doc["traceEvents"] if e.get("cat") == "op"]
    inner = [e for e in doc["traceEvents"] if e.get("cat") == "transfer"]
    return doc, ops, inner


def _check_ops(ops, rank):
    assert [e["name"] for e in ops] == ["all_reduce", "all_gather"] * 3
    assert [e["args"]["seq"] for e in ops] == list(range(6))
    assert all(e["pid"] == rank and e["tid"] == 0 for e in ops)
    assert ops[0]["args"]["call"] == "all_reduce(float32, count=1000, op=SUM)"


def _inside(inner, ops):
    """Every transfer span lies within the span of its op."""
    by_seq = {e["args"]["seq"]: e for e in ops}
    for t in inner:
        op = by_seq[t["args"]["seq"]]
        assert t["args"]["op"] == op["name"] and t["tid"] == op["tid"]
        assert op["ts"] <= t["ts"] and t["ts"] + t["dur"] <= op["ts"] + op["dur"] + 1e-3


def test_tcp_trace_has_op_spans_with_sends_and_receives_inside(tmp_path):
    prefix = _traced_job(tmp_path, "tcp")
    for rank in (0, 1):
        doc, ops, inner = _spans(f"{prefix}.rank{rank}.json")
        _check_ops(ops, rank)
        assert all(e["args"]["component"] == "tcp" for e in ops)
        assert {e["name"] for e in inner} == {f"send -> {1 - rank}", f"recv <- {1 - rank}"}
        assert all(e["args"]["bytes"] == 4000 and e["args"]["peer"] == 1 - rank for e in inner)
        assert {e["args"]["seq"] for e in inner} == set(range(6))
        _inside(inner, ops)
        names = [e for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
        assert names[0]["args"]["name"] == "group WORLD"
        assert doc["otherData"]["rank"] == rank and doc["otherData"]["world_size"] == 2
    other = json.load(open(f"{prefix}.rank1.json"))["otherData"]
    assert other["clock_rtt_us"] > 0 and abs(other["clock_offset_us"]) <= other["clock_rtt_us"]

    out = tmp_path / "job.json"
    run = subprocess.run([sys.executable, "-m", "chorus.cli", "trace", "merge", prefix, "-o", str(out)],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    assert run.returncode == 0 and "2 rank(s)" in run.stdout
    job = json.load(open(out))
    spans = [e for e in job["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1} and min(e["ts"] for e in spans) == 0
    assert job["otherData"]["clocks"]["1"]["same_clock_as_rank0"] is True


def test_shm_trace_has_op_spans_with_syncs_and_copies_inside(tmp_path):
    prefix = _traced_job(tmp_path, "shm")
    inner_seen = []
    for rank in (0, 1):
        _, ops, inner = _spans(f"{prefix}.rank{rank}.json")
        _check_ops(ops, rank)
        assert all(e["args"]["component"] == "shm" for e in ops)
        _inside(inner, ops)
        inner_seen.append({e["name"].split()[0] for e in inner})
        assert {e["args"]["seq"] for e in inner} == set(range(6))  # every op has spans inside
    for names in inner_seen:  # the window's phases: syncs, and copies or reductions
        assert "sync" in names and names & {"copy", "reduce"} and names <= {"sync", "copy", "reduce"}, names


def test_chrome_events_pair_begin_and_end_and_keep_transfers():
    def ev(what, start, end, peer=-1, nbytes=0, **detail):
        return Event(what, 3, 7, "all_reduce", 0x0801 | (4 << 31), "tcp", "ring", peer, nbytes, start, end, detail)

    events = [ev("begin", 1.0, 1.0), ev("send", 1.1, 1.5, peer=2, nbytes=64), ev("phase", 1.2, 1.3, group="x"),
              ev("end", 1.6, 1.6), ev("end", 9.0, 9.0)]  # the last has no begin: dropped
    out = chrome_events(events, rank=5, names={3: "dp"})
    spans = [e for e in out if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["all_reduce", "send -> 2", "phase"]
    op, send, phase = spans
    assert op["ts"] == pytest.approx(1e6) and op["dur"] == pytest.approx(0.6e6) and op["tid"] == 3
    assert send["args"] == {"op": "all_reduce", "seq": 7, "bytes": 64, "component": "tcp", "peer": 2,
                            "algorithm": "ring"}
    assert phase["args"]["group"] == "x" and "peer" not in phase["args"]
    assert {"name": "group dp"} in [e["args"] for e in out if e["name"] == "thread_name"]


def test_replay_finds_the_phases_and_channel_parts_of_their_ops():
    """A hierarchy's phase names its sub-group in args["group"] (a string): it stays with
    its op on the group's track; a channel part's transfer names its group there too, from
    a track of its own."""
    from chorus.explain.replay import ops_of

    def ev(what, seq, peer=-1, **detail):
        return Event(what, 0, seq, "all_reduce", 0x0801, "hierarchical", "ring", peer, 8, 1.0, 2.0, detail)

    events = [ev("begin", 0), ev("phase", 0, group="g/host1"), ev("end", 0),
              ev("begin", 1), ev("send", 1, peer=1, channel=1), ev("send", 1, peer=1, channel=0), ev("end", 1)]
    ops = ops_of({"traceEvents": chrome_events(events, rank=0)})
    assert [(op.seq, len(op.transfers[0])) for op in ops] == [(0, 1), (1, 2)]


def test_merge_shifts_ranks_of_another_clock_by_their_offset(tmp_path):
    def write(rank, boot, offset_us, ts):
        doc = {"traceEvents": [{"ph": "X", "pid": rank, "tid": 0, "cat": "op", "name": "barrier", "ts": ts,
                                "dur": 5.0, "args": {"seq": 0}}],
               "otherData": {"chorus_trace": 1, "rank": rank, "world_size": 3, "clock_offset_us": offset_us,
                             "clock_rtt_us": 10.0, "boot_id": boot}}
        (tmp_path / f"t.rank{rank}.json").write_text(json.dumps(doc))

    write(0, "A", 0.0, 1000.0)
    write(1, "A", 3.0, 1010.0)  # same boot: one clock, the measured 3 us are noise
    write(2, "B", 500.0, 520.0)  # another host: rank 0's time = its own + 500
    job = merge(str(tmp_path / "t"))
    ts = {e["pid"]: e["ts"] for e in job["traceEvents"]}
    assert ts == {0: 0.0, 1: 10.0, 2: 20.0}
    assert job["otherData"]["clocks"][1] == {"offset_us": 0.0, "measured_offset_us": 3.0, "rtt_us": 10.0,
                                             "same_clock_as_rank0": True}


def test_measure_offset_through_a_store():
    store, results = HashStore(), {}

    def rank(r):
        results[r] = measure_offset(store, r, 3, rounds=3)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results[0] == (0.0, 0.0)
    for r in (1, 2):
        offset, rtt = results[r]
        assert 0 < rtt < 1 and abs(offset) <= rtt  # one clock: the offset is within the uncertainty
