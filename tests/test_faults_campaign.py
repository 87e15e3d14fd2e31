"""Fault injection in CI: the campaigns of tools/fault_campaign.py (their full runs give
the results in docs/results/2-vcpu-epyc/hardening/) at a small scale.

* a flood of idle connections and a slow-loris against every port a job's ranks listen
  on, during set-up, with the ranks' open-file limit at 128: the job sets up, its results
  are right, and no handshake thread lives past the handshake deadline;
* jobs started by hand killed with SIGKILL at seeded random moments (seed 7: in the ops,
  at a rank's start, in the ops; one rank, or all): none leaves a chorus file in
  /dev/shm, and every job ends (a rank whose store host died at its start times out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from proc_support import REPO

pytestmark = pytest.mark.slow


def _campaign(tmp_path, *argv: str) -> dict:
    out = tmp_path / "result.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "fault_campaign.py"), *argv, "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert out.exists(), r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"].startswith("python3 tools/fault_campaign.py " + argv[0])
    return result


def test_a_job_sets_up_and_runs_right_under_a_flood_and_a_slow_loris_with_128_descriptors(tmp_path):
    result = _campaign(tmp_path, "flood", "--connections", "120", "--loris", "30", "--interval", "0.5",
                       "--nofile", "128", "--ops", "20", "--hold", "1", "--delay", "0.5", "--timeout", "60")
    summary = result["summary"]
    assert summary["job_set_up_and_finished"] and summary["wrong_results"] == 0, result["ranks"]
    assert summary["ops_checked"] == 2 * 2 * 20
    assert summary["no_thread_outlived_the_deadline"], summary
    assert all(port["idle_opened"] == 120 for port in result["ports"].values())  # the attack did happen


def test_jobs_killed_at_random_moments_leave_nothing_in_dev_shm(tmp_path):
    result = _campaign(tmp_path, "kills", "--jobs", "3", "--launchers", "manual", "--seconds", "0.5", "--seed", "7",
                       "--timeout", "3")
    summary = result["summary"]
    assert summary["unkilled_runs_clean"] and summary["jobs_killed"] == 3, result
    assert summary["files_left_by_jobs"] == [] and summary["jobs_not_ended_within_grace"] == 0, result["jobs"]
