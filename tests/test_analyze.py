"""``chorus analyze`` (chorus.debug.analyze) on hand-made dumps, its exit codes, and the
summary chorusrun prints when a job fails with CHORUS_FLIGHT_RECORDER_DIR set."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

from proc_support import REPO

from chorus.debug.analyze import analyze, main

AR = "all_reduce(float32, count=4, op=SUM)"


def op(seq, state="done", name="all_reduce", call=AR, error=None, waiting=(), lost=None):
    return {"seq": seq, "op": name, "dtype": "float32", "count": 4, "nbytes": 16, "reduce_op": "SUM",
            "root": -1, "async": False, "component": "shm", "algorithm": "window", "lane": True,
            "state": state, "issued": 100.0 + seq, "started": 100.0 + seq,
            "ended": 100.5 + seq if state in ("done", "failed") else None, "error": error,
            "lost_rank": lost, "waiting_on": list(waiting), "fingerprint": 1, "call": call}


def write(tmp_path, rank, entries, reason="requested", members=(0, 1, 2, 3), groups=None):
    data = {"version": 1, "rank": rank, "pid": 1000 + rank, "host": "h", "reason": reason, "time": 200.0,
            "groups": groups or [{"id": 0, "name": "WORLD", "members": list(members), "group_rank": rank,
                                  "size": 2000, "entries": entries}]}
    (tmp_path / f"rank{rank}.json").write_text(json.dumps(data))


def test_a_clean_job_has_no_finding_and_exit_code_0(tmp_path, capsys):
    for r in range(2):
        write(tmp_path, r, [op(0), op(1)], members=(0, 1))
    report = analyze(str(tmp_path))
    assert not report.problem and report.ranks == [0, 1]
    assert main([str(tmp_path)]) == 0
    assert "no problem found" in capsys.readouterr().out


def test_no_dump_at_all_is_exit_code_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no flight recorder dumps" in capsys.readouterr().out


def test_the_rank_behind_and_its_waiters(tmp_path):
    timeout = "CommTimeoutError: all_reduce (seq 3) on group 0: rank(s) [2] did not arrive at shared-memory sync"
    for r in (0, 1, 3):
        write(tmp_path, r, [op(0), op(1), op(2), op(3, "failed", error=timeout, waiting=[2])],
              reason=timeout)
    write(tmp_path, 2, [op(0), op(1), op(2)], reason="signal SIGTERM")
    report = analyze(str(tmp_path))
    assert [(f.kind, f.ranks, f.seq) for f in report.findings] == [("behind", [2], 3)]
    assert "BEHIND: rank 2 never called op #3 " + AR in report.text
    assert "its last op was #2 " + AR in report.text
    assert "WAITING: ranks 0, 1, 3 in op #3 " + AR + ", waiting for rank 2" in report.text


def test_behind_while_the_others_were_still_waiting_when_stopped(tmp_path):
    """No error (a launcher's SIGTERM stopped the job): the ranks behind are still found."""
    for r in (0, 1):
        write(tmp_path, r, [op(0), op(1, "started")], reason="signal SIGTERM", members=(0, 1, 2))
    write(tmp_path, 2, [op(0)], reason="signal SIGTERM", members=(0, 1, 2))
    report = analyze(str(tmp_path))
    assert [(f.kind, f.ranks, f.seq) for f in report.findings] == [("behind", [2], 1)]
    assert "waiting for rank 2" in report.text
    assert "rank 0: started for 99.0 s when it dumped (signal SIGTERM)" in report.text


def test_mismatch_side_by_side(tmp_path):
    ag = "all_gather(float32, count=4)"
    for r in range(3):
        entries = [op(0), op(1, "failed", name="all_gather" if r == 1 else "all_reduce",
                          call=ag if r == 1 else AR, error="CollectiveMismatchError: ...")]
        write(tmp_path, r, entries, members=(0, 1, 2))
    report = analyze(str(tmp_path))
    assert report.findings[0].kind == "mismatch" and report.findings[0].ranks == [1]
    assert re.search(r"ranks 0, 2 +" + re.escape(AR), report.text)
    assert re.search(r"rank 1 +" + re.escape(ag), report.text)
    assert "#1  all_reduce(float32,4) failed  all_gather(float32,4) failed  all_reduce(float32,4) failed" \
        in report.text


def test_a_mismatch_told_by_a_peer_whose_culprit_left_no_dump(tmp_path):
    error = ("CollectiveMismatchError: collective mismatch on group 0 (this rank is rank 0): ranks [0, 1] "
             "called " + AR + " as op #1; rank 2 called broadcast(float32, count=4, root=0) as op #1. The group "
             "is unusable from now on.")
    for r in (0, 1):
        write(tmp_path, r, [op(0), op(1, "failed", error=error)], members=(0, 1, 2))
    report = analyze(str(tmp_path))
    kinds = [f.kind for f in report.findings]
    assert kinds[0] == "mismatch" and report.findings[0].ranks == [2]
    assert "broadcast(float32, count=4, root=0) (as a peer's error reports)" in report.text
    assert "no_dump" in kinds


def test_a_lost_rank(tmp_path):
    lost = "PeerLostError: all_reduce (seq 2) on group 0: rank 1 died (connection lost: EOF)"
    for r in (0, 2):
        write(tmp_path, r, [op(0), op(1), op(2, "failed", error=lost, lost=1)], members=(0, 1, 2))
    report = analyze(str(tmp_path))
    (finding,) = [f for f in report.findings if f.kind == "no_dump"]
    assert finding.ranks == [1] and finding.seq == 2
    assert "its peers last completed op #1 " + AR + " with it" in finding.text
    assert "rank 1 was lost" in report.text
    assert report.text.rstrip().splitlines()[-2].startswith("diagnosis: group WORLD (id 0): rank 1 left no dump")


def test_groups_are_analysed_one_by_one(tmp_path):
    def groups(sub_entries):
        return [{"id": 0, "name": "WORLD", "members": [0, 1], "group_rank": 0, "size": 8, "entries": [op(0)]},
                {"id": 1, "name": "1", "members": [0, 1], "group_rank": 0, "size": 8, "entries": sub_entries}]

    write(tmp_path, 0, [], groups=groups([op(0), op(1, "started")]))
    write(tmp_path, 1, [], groups=groups([op(0)]))
    report = analyze(str(tmp_path))
    assert [(f.kind, f.group, f.ranks) for f in report.findings] == [("behind", "1", [1])]
    assert "group WORLD (id 0), ranks 0, 1:\n  every rank finished every op" in report.text


def test_old_dumps_are_ignored_with_since(tmp_path):
    write(tmp_path, 0, [op(0, "started")], members=(0,))
    assert analyze(str(tmp_path), since=300.0).ranks == []
    assert analyze(str(tmp_path), since=100.0).ranks == [0]


def test_chorusrun_prints_the_analysis_when_the_job_fails(tmp_path, job):
    script = tmp_path / "mismatch.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        import chorus as dist
        dist.init_process_group("chorus", timeout=10)
        t = np.ones(4, np.float32)
        for i in range(4):
            if i == 2 and dist.get_rank() == 1:
                dist.broadcast(t, src=0)
            else:
                dist.all_reduce(t)
    """))
    dumps = tmp_path / "fr"
    env = dict(os.environ, CHORUS_FLIGHT_RECORDER_DIR=str(dumps), PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, "-m", "chorus.run", "--nproc-per-node", "2", "--master-port", "0", str(script)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode != 0
    assert f"chorusrun: the flight recorders in {dumps} say:" in run.stderr
    assert "MISMATCH at op #2" in run.stderr
    assert "diagnosis: group WORLD (id 0): op #2 is a mismatch" in run.stderr


def test_the_silent_ranks_are_read_from_every_timeout_wording():
    from chorus.debug.flight import waiting_on

    assert waiting_on("recv from rank 1 (seq 2): Timed out waiting for the op's transfers: "
                      "no answer from ranks [1, 3].") == [1, 3]
    assert waiting_on("all_reduce (seq 5) on group 0: Timed out after 10.0 s (the group's timeout): "
                      "rank(s) [2] did not arrive at shared-memory sync #6") == [2]
    assert waiting_on("Ranks 1, 2 failed to pass monitoredBarrier in 100 ms (op #0 of group WORLD)") == [1, 2]
    assert waiting_on("Rank 3 failed to pass monitoredBarrier in 100 ms") == [3]
    assert waiting_on("Rank 0 timed out in monitoredBarrier after 0 ms") == []
