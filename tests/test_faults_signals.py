"""Fault injection: a rank stopped by SIGSTOP, briefly and then for good, in a real job.

Three ranks (processes, shared memory and TCP) loop over small all_reduces.  A stop
shorter than the heartbeat timeout costs nothing: the job goes on, every sum right.  A
longer one makes rank 0 (heartbeat timeout 2 s; the others 30 s) declare rank 2 lost and
exit at once on the PeerLostError; rank 1 must still name rank 2 — told by rank 0 before
rank 0's exit closed its connections — not rank 0, whose end it also sees.  Continued,
rank 2 finds itself cut off and raises too.

The other faults of the suite live next to what they break: partitions in network
namespaces (test_partition.py), crafted headers and floods against one transport
(test_tcp_hardening.py), hostile objects without a token (test_safe_objects.py), two
threads on one group (test_threads_one_group.py); kill -9 at random moments and floods
during a job's set-up run tools/fault_campaign.py at a small scale (test_faults_campaign.py).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from proc_support import REPO, leftovers, reserved_port, wait_until

pytestmark = pytest.mark.slow

WORLD, SHORT_HEARTBEAT = 3, 2.0

_RANK = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import chorus as dist

    out, rank = sys.argv[1], int(os.environ["RANK"])
    os.environ["CHORUS_HEARTBEAT_TIMEOUT"] = sys.argv[2] if rank == 0 else "30"
    dist.init_process_group("gloo", timeout=30)
    x = np.empty(4, np.float32)
    ops = wrong = 0
    try:
        while True:
            x[:] = rank + 1
            dist.all_reduce(x)
            wrong += int(not (x == 6).all())
            ops += 1
            if rank == 0 and ops % 50 == 0:  # progress, for the test
                with open(f"{out}/ops.tmp", "w") as f:
                    f.write(str(ops))
                os.replace(f"{out}/ops.tmp", f"{out}/ops")
    except dist.ChorusError as exc:
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump({"time": time.time(), "ops": ops, "wrong": wrong, "lost": getattr(exc, "lost_rank", None),
                       "error": f"{type(exc).__name__}: {exc}"}, f)
        if rank == 0:
            raise  # the rank that noticed exits at once, through the uncaught exception
""")


def _ops(out) -> int:
    try:
        return int((out / "ops").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def _report(out, rank: int) -> dict | None:
    path = out / f"rank{rank}.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_a_stopped_rank_is_waited_for_briefly_and_named_by_every_rank_once_lost(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    job = "test" + secrets.token_hex(6)
    env = dict(os.environ, WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", CHORUS_JOB_ID=job,
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    with reserved_port() as port:
        procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), str(SHORT_HEARTBEAT)],
                                  env=dict(env, RANK=str(r), MASTER_PORT=str(port)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(WORLD)]
    victim = procs[2]
    try:
        assert wait_until(lambda: _ops(tmp_path) >= 50, 30), "the job did not start"
        victim.send_signal(signal.SIGSTOP)  # shorter than rank 0's heartbeat timeout
        time.sleep(0.3)
        victim.send_signal(signal.SIGCONT)
        before = _ops(tmp_path)
        assert wait_until(lambda: _ops(tmp_path) >= before + 100, 10), "the job did not go on after SIGCONT"

        victim.send_signal(signal.SIGSTOP)  # for good
        stopped = time.time()
        assert wait_until(lambda: procs[0].poll() is not None and procs[1].poll() is not None, 15)
        victim.send_signal(signal.SIGCONT)
        continued = time.time()
        victim.wait(10)
    finally:
        for p in procs:
            p.kill()
        errs = [p.communicate()[1] for p in procs]
    reports = [_report(tmp_path, r) for r in range(WORLD)]
    assert all(reports), [e[-1500:] for e, r in zip(errs, reports, strict=True) if not r]
    assert [r["wrong"] for r in reports] == [0] * WORLD
    assert procs[0].returncode == 1 and "PeerLostError" in errs[0]  # exited on the uncaught error
    for rank in (0, 1):
        r = reports[rank]
        assert r["lost"] == 2 and r["error"].startswith("PeerLostError") and "rank 2 stopped answering" in r["error"], \
            (rank, r)
        assert r["time"] - stopped < SHORT_HEARTBEAT + 3.0, (rank, r["time"] - stopped)
    assert "(reported by rank 0)" in reports[1]["error"], reports[1]
    # cut off, rank 2 raises (its peers are gone, or its window was given up), it does not hang
    assert reports[2]["time"] - continued < 5.0, reports[2]
    assert not leftovers(job)
