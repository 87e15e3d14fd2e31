"""Tests of ``chorus.launch.spawn`` with real processes (the default ``spawn`` start method).

The target functions live at module level so that the children can unpickle them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_support import REPO, is_alive

from chorus.launch import (
    ProcessExitedException,
    ProcessRaisedException,
    SpawnContext,
    spawn,
)


def write_result(i: int, out_dir: str, factor: int) -> None:
    env = {k: os.environ.get(k) for k in ("CHORUS_TOKEN", "CHORUS_JOB_ID")}
    Path(out_dir, f"{i}.json").write_text(json.dumps({"value": i * factor, "pid": os.getpid(),
                                                      **env}))


def _fail_deep(i: int) -> None:
    raise ValueError(f"boom in child {i}")


def raise_in_one(i: int, bad: int, stubborn: int, out_dir: str) -> None:
    if i == stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops this one
    Path(out_dir, f"{i}.pid").write_text(str(os.getpid()))
    if i == bad:
        while len(list(Path(out_dir).glob("*.pid"))) < 3:  # let the others start first
            time.sleep(0.02)
        Path(out_dir, "failed_at").write_text(repr(time.time()))
        _fail_deep(i)
    time.sleep(60)


def kill_self(i: int) -> None:
    if i == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def sleep_briefly(i: int, seconds: float) -> None:
    time.sleep(seconds)


def test_results_and_shared_token(tmp_path, monkeypatch):
    monkeypatch.delenv("CHORUS_TOKEN", raising=False)
    assert spawn(write_result, args=(str(tmp_path), 10), nprocs=3) is None
    results = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(3)]
    assert [r["value"] for r in results] == [0, 10, 20]
    assert len({r["pid"] for r in results} | {os.getpid()}) == 4
    tokens = {r["CHORUS_TOKEN"] for r in results}
    assert len(tokens) == 1 and len(tokens.pop()) == 32
    jobs = {r["CHORUS_JOB_ID"] for r in results}
    assert len(jobs) == 1 and jobs.pop()
    assert "CHORUS_TOKEN" not in os.environ  # the parent's environment is untouched


def test_forkserver_children_run(tmp_path):
    """A forkserver's children are the fork server's, not this process's: spawn does not
    tie them to its pid (they would kill themselves at start)."""
    spawn(write_result, args=(str(tmp_path), 5), nprocs=2, start_method="forkserver")
    results = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    assert [r["value"] for r in results] == [0, 5]


def test_parent_token_is_passed_on(tmp_path, monkeypatch):
    monkeypatch.setenv("CHORUS_TOKEN", "parent-token")
    spawn(write_result, args=(str(tmp_path), 1), nprocs=2)
    assert [json.loads((tmp_path / f"{i}.json").read_text())["CHORUS_TOKEN"]
            for i in range(2)] == ["parent-token", "parent-token"]


def test_exception_in_one_child_stops_the_others(tmp_path):
    with pytest.raises(ProcessRaisedException) as info:
        spawn(raise_in_one, args=(1, 2, str(tmp_path)), nprocs=3)
    # child 2 ignores SIGTERM: it took the SIGKILL, and all stopped within 5 s
    stopped_after = time.time() - float((tmp_path / "failed_at").read_text())
    assert 2.0 < stopped_after < 5.5
    err = info.value
    assert err.error_index == 1
    assert err.error_pid == int((tmp_path / "1.pid").read_text())
    msg = str(err)
    assert "-- Process 1 terminated with the following error:" in msg
    assert "Traceback (most recent call last)" in msg
    assert "in _fail_deep" in msg and "ValueError: boom in child 1" in msg
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 3 and not any(is_alive(p) for p in pids)


def test_child_killed_by_signal(tmp_path):
    with pytest.raises(ProcessExitedException) as info:
        spawn(kill_self, nprocs=2)
    err = info.value
    assert (err.error_index, err.exit_code, err.signal_name) == (1, -signal.SIGKILL, "SIGKILL")
    assert "process 1 terminated with signal SIGKILL" in str(err)


def test_join_false_returns_a_context():
    ctx = spawn(sleep_briefly, args=(0.5,), nprocs=2, join=False)
    assert isinstance(ctx, SpawnContext)
    assert len(ctx.pids()) == 2 and all(p > 0 for p in ctx.pids())
    assert ctx.join(timeout=0.01) is False  # still sleeping
    deadline = time.monotonic() + 30
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline
    assert all(p.exitcode == 0 for p in ctx.processes)
    assert ctx.join() is True


_SCRIPT = """
import os
import sys

import numpy as np

import chorus as mp  # the seeds' spelling of torch.multiprocessing


def run(rank, world, workdir):
    import chorus as dist

    dist.init_process_group("gloo", init_method=f"file://{workdir}/rdzv", rank=rank, world_size=world)
    t = np.array([rank + 1])
    dist.all_reduce(t)
    os.write(1, f"rank {rank} of {world}: {int(t[0])}\\n".encode())  # one write: lines never interleave
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(3, sys.argv[1]), nprocs=3)
"""


def test_a_script_that_spawns_a_function_of_its_own_as_users_run_it(tmp_path):
    """``python script.py`` whose ``run`` lives in ``__main__``: the spawned interpreters
    import the script again (as ``__mp_main__``) to find it, as the seeds' examples do."""
    script = tmp_path / "spawning.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [f"rank {r} of 3: 6" for r in range(3)]
