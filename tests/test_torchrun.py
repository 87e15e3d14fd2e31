"""chorus scripts under the real torchrun: standalone, and two nodes over loopback.  The
agent serves its (torch) store on MASTER_PORT; chorus rendezvouses through it instead of
opening a second store there.  Without a token, a job on one host still authenticates
its transport with a derived secret (chorus.host.secret)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from proc_support import reports, reserved_port

pytest.importorskip("torch", reason="torchrun is torch's launcher")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")
AUTH_REPORT = os.path.join(ROOT, "tests", "launch_scripts", "auth_report.py")
pytestmark = pytest.mark.slow


def torchrun(*args: str, script: str = QUICKSTART) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("CHORUS_TRANSPORT", None)
    env.pop("CHORUS_TOKEN", None)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, script],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out
    return out


def test_two_nodes_over_loopback():
    """One rank per node: node 1's rank is global rank 1 with LOCAL_RANK 0, reached through
    the agents' store on node 0 (each rank under torchrun imports torch, the cost here)."""
    with reserved_port() as port:
        common = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}"]
        nodes = [torchrun(*common, f"--node-rank={n}") for n in (0, 1)]
        out = "".join(finish(p) for p in nodes)
    assert "rank 1 of 2 is up" in out and "gathered [0, 1]" in out and "all ranks passed the barrier" in out


def test_standalone_without_a_token_is_authenticated():
    """``torchrun --standalone`` on a chorus-API script: torch's store stays open, but the
    ranks' transport proves the derived secret: it refuses a connection that proves
    nothing, trusts the peers' objects, and nothing warns.  (The quickstart under torchrun:
    test_two_nodes_over_loopback.)"""
    out = finish(torchrun("--standalone", "--nproc-per-node=2", script=AUTH_REPORT))
    found = sorted(reports(out), key=lambda r: r["rank"])
    assert found == [{"rank": 0, "authenticated": True, "transport_refuses": True, "objects": [0, 1]},
                       {"rank": 1, "authenticated": True, "objects": [0, 1]}], out
    assert "no job token" not in out
