"""chorus.torch end to end: a rank killed in the middle of DDP training, and the DDP /
DeviceMesh examples under chorusrun and torchrun."""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import time

import pytest

torch = pytest.importorskip("torch", reason="chorus.torch needs torch (pip install 'chorus[torch]')")

import torch.distributed as tdist  # noqa: E402
from proc_support import torch_forkserver  # noqa: E402
from torch_training import MLP  # noqa: E402 - the model the DDP tests train

import chorus.torch  # noqa: E402, F401 - registers the backend

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# -- a rank killed in the middle of DDP training ------------------------------------------------
def _ddp_killed_worker(rank, world, workdir):
    tdist.init_process_group("chorus", init_method=f"file://{workdir}/rdv", rank=rank, world_size=world)
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    outcome = "finished without an error"
    try:
        for step in range(2000):
            if rank == world - 1 and step == 5:
                _report(workdir, rank, "killed")
                os.kill(os.getpid(), signal.SIGKILL)
            torch.nn.functional.mse_loss(model(torch.randn(8, 16)), torch.zeros(8, 4)).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.005)
    except Exception as exc:  # noqa: BLE001
        outcome = f"{type(exc).__name__}: {exc}"
    _report(workdir, rank, outcome)


def _report(workdir, rank, what):
    with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
        json.dump([what, time.time()], f)


def test_killed_rank_in_ddp_fails_every_rank_within_5s():
    world = 3
    with tempfile.TemporaryDirectory(prefix="chorus-torch-kill-") as workdir:
        ctx = torch_forkserver()  # not chorus.spawn (it would stop the survivors) nor run_forked
        procs = [ctx.Process(target=_ddp_killed_worker, args=(r, world, workdir)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        for p in procs:
            if p.is_alive():
                p.kill()
        reports = {}
        for r in range(world):
            path = os.path.join(workdir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    reports[r] = json.load(f)
    assert reports.get(world - 1, [None])[0] == "killed", reports
    killed_at = reports[world - 1][1]
    for r in range(world - 1):
        what, when = reports[r]
        assert "PeerLostError" in what and f"rank {world - 1}" in what, what
        assert when - killed_at < 5.0, (r, when - killed_at)


# -- the examples, under both launchers ---------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(launcher, nproc, script, *args):
    import subprocess
    import sys

    cmd = ([sys.executable, "-m", "chorus.run", "--master-port", "0"] if launcher == "chorusrun"
           else [sys.executable, "-m", "torch.distributed.run", "--standalone"])
    out = subprocess.run([*cmd, "--nproc-per-node", str(nproc), os.path.join(ROOT, "examples", script), *args],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [re.sub(r"^\[rank\d+\]:", "", line) for line in out.stdout.splitlines()]


def test_ddp_example_under_chorusrun():
    lines = _launch("chorusrun", 2, "ddp_train.py", "--steps", "3")
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert sum(line.startswith("Rank ") for line in lines) == 2


def test_device_mesh_example_with_torch_s_mesh_and_natively():
    """torch's DeviceMesh over backend "chorus", then chorus.DeviceMesh (chorusrun starts
    both: torchrun interop has tests/test_torchrun.py)."""
    text = "\n".join(_launch("chorusrun", 2, "device_mesh.py"))  # two ranks' prints may interleave
    assert "rank 1 at [1, 0]: dp group [0, 1] sum 1, tp group [1] sum 1 (chorus)" in text
    assert "round trip exact: True" in text
    lines = _launch("chorusrun", 4, "device_mesh.py", "--native")
    assert "rank 3 at [1, 1]: dp group [1, 3] sum 4, tp group [2, 3] sum 5; mesh['tp'] = [2, 3]" in lines
