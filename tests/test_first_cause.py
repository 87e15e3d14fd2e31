"""A rank that raises is what every launcher reports, and what the other ranks' errors name.

In ``first_cause_job``, rank 1 raises ValueError while the others wait for it in an
all_reduce; they fail with PeerLostError a moment later.  ``chorus.spawn``, torch's
``mp.spawn`` (``start_processes``) and chorusrun must each report rank 1's ValueError, every
time.  Each launcher runs the job FIRST_CAUSE_RUNS times (default 3) on FIRST_CAUSE_WORLD
ranks (default 2); for the full check::

    FIRST_CAUSE_RUNS=20 FIRST_CAUSE_WORLD=3 FIRST_CAUSE_TORCH_START=spawn \
        python -m pytest tests/test_first_cause.py -k reports_the_rank --timeout 1200

(``spawn`` is mp.spawn's own start method; by default torch's children are forks of the
test's torch forkserver, which saves each of them importing torch.)
"""

from __future__ import annotations

import io
import json
import multiprocessing.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import first_cause_job
import pytest
from proc_support import REPO, reserved_port, run_ranks, torch_forkserver

from chorus.errors import PeerLostError
from chorus.launch import ProcessRaisedException, spawn
from chorus.launch.supervisor import RankSpec, Supervisor

RUNS = int(os.environ.get("FIRST_CAUSE_RUNS", "3"))
TORCH_START = os.environ.get("FIRST_CAUSE_TORCH_START", "forkserver")
WORLD = int(os.environ.get("FIRST_CAUSE_WORLD", "2"))
CAUSE = f"ValueError: {first_cause_job.MESSAGE}"
pytestmark = pytest.mark.slow


def check_runs(run_once) -> None:
    """Run the job RUNS times; ``run_once()`` returns what was reported (None if right)."""
    wrong = [(i, why) for i in range(RUNS) if (why := run_once()) is not None]
    assert not wrong, f"{len(wrong)} of {RUNS} runs reported something else: {wrong}"


def test_chorus_spawn_reports_the_rank_that_raised():
    def run_once():
        with reserved_port() as port, pytest.raises(ProcessRaisedException) as info:
            spawn(first_cause_job.job, args=(WORLD, f"tcp://127.0.0.1:{port}"), nprocs=WORLD)
        ok = info.value.error_index == 1 and CAUSE in str(info.value)
        return None if ok else (info.value.error_index, str(info.value).strip().splitlines()[-1])

    check_runs(run_once)


def test_torch_spawn_reports_the_rank_that_raised():
    mp = pytest.importorskip("torch.multiprocessing")
    if TORCH_START == "forkserver":
        torch_forkserver()

    def run_once():
        with reserved_port() as port, pytest.raises(mp.ProcessRaisedException) as info:
            mp.start_processes(first_cause_job.job, args=(WORLD, f"tcp://127.0.0.1:{port}"),
                               nprocs=WORLD, start_method=TORCH_START)
        ok = info.value.error_index == 1 and CAUSE in str(info.value)
        return None if ok else (info.value.error_index, str(info.value).strip().splitlines()[-1])

    check_runs(run_once)


def test_chorusrun_reports_the_rank_that_raised():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))

    def run_once():
        r = subprocess.run([sys.executable, "-m", "chorus.run", "--nproc-per-node", str(WORLD), "--master-port",
                            "0", first_cause_job.__file__], capture_output=True, text=True, env=env, timeout=60)
        report = r.stderr[r.stderr.find("=" * 72):]
        ok = "rank 1 (local rank 1" in report and f"its error: {CAUSE}" in report
        return None if ok else report.splitlines()[1:3]

    check_runs(run_once)


def test_the_other_ranks_errors_name_the_cause():
    procs, outputs = run_ranks([sys.executable, first_cause_job.__file__, "--catch"], 3)
    assert [p.returncode for p in procs] == [0, 1, 0], outputs
    assert CAUSE in outputs[1][1]
    for rank in (0, 2):  # told by rank 1, or by the other survivor first
        assert re.fullmatch(f"rank {rank} caught: all_reduce \\(seq 1\\) on group 0: rank 1 failed with {CAUSE}"
                            f"( \\(reported by rank {2 - rank}\\))?; every op of group 0 involving it fails on "
                            f"every rank. Look at rank 1's output for its own error.\n", outputs[rank][0])


# -- the choice among several failures, without a job ------------------------------------------

def _mark_then_linger(marker: str) -> None:
    Path(marker).touch()
    time.sleep(30)


def raise_unless_first(i: int, outdir: str) -> None:
    """Child 1 raises ValueError but is slow to exit (its exit finalizer, which runs after
    spawn wrote its error, lingers); child 0 then fails "because of it" and exits first."""
    marker = os.path.join(outdir, "raised")
    if i == 1:
        multiprocessing.util.Finalize(None, _mark_then_linger, args=(marker,), exitpriority=1)
        raise ValueError("the cause")
    while not os.path.exists(marker):
        time.sleep(0.01)
    raise PeerLostError("rank 1 failed", lost_rank=1)


def test_spawn_reports_the_first_error_of_its_own_not_the_first_exit(tmp_path):
    ctx = spawn(raise_unless_first, args=(str(tmp_path),), nprocs=2, join=False)
    with pytest.raises(ProcessRaisedException) as info:
        while not ctx.join(grace_period=0.5):
            pass
    assert info.value.error_index == 1 and "ValueError: the cause" in str(info.value)
    assert ctx.processes[0].exitcode == 1 and ctx.processes[1].exitcode < 0  # 1 was stopped


def test_chorusrun_reports_the_earliest_error_file_not_the_first_exit():
    # rank 1 writes its error (as chorus does when a rank raises) and is slow to exit; rank 0
    # then exits 1 at once, as a survivor would
    code = ("import json, os, sys, time\n"
            "path = os.environ['TORCHELASTIC_ERROR_FILE']\n"
            "if os.environ['RANK'] == '1':\n"
            "    json.dump({'message': {'message': 'ValueError: the cause', 'extraInfo': {'py_callstack': '',"
            " 'timestamp': str(int(time.time()))}}, 'chorus': {'time': time.time()}}, open(path + '.tmp', 'w'))\n"
            "    os.replace(path + '.tmp', path)\n"
            "    time.sleep(30)\n"
            "while not os.path.exists(path.replace('rank0', 'rank1')):\n"
            "    time.sleep(0.01)\n"
            "sys.exit(1)\n")
    specs = [RankSpec(r, r, [sys.executable, "-c", code], dict(os.environ, RANK=str(r))) for r in range(2)]
    outcome = Supervisor(specs, grace_s=0.5, stdout=io.StringIO(), stderr=io.StringIO()).run()
    first = outcome.first_failure
    assert (first.rank, first.error, outcome.exit_code) == (1, "ValueError: the cause", 128 + 15)


def test_a_rank_that_raises_writes_its_error_where_the_launcher_looks(tmp_path):
    path = tmp_path / "error.json"
    script = tmp_path / "fails.py"
    script.write_text("import chorus as dist\n"
                      "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
                      "raise KeyError('missing')\n")
    env = dict(os.environ, TORCHELASTIC_ERROR_FILE=str(path),
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    before = time.time()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and "KeyError: 'missing'" in r.stderr
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "KeyError: 'missing'"
    assert "raise KeyError('missing')" in data["message"]["extraInfo"]["py_callstack"]
    assert before <= data["chorus"]["time"] <= time.time()
