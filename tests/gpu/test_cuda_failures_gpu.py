"""Failures of chorus.cuda on up to 4 GPUs, through ``import chorus as dist`` (backend "nccl"),
one process per GPU (tests/gpu/failure_workers.py, started with subprocess):

* a rank SIGKILLed in the middle of a loop of all_reduces: every other rank raises
  PeerLostError within 5 s of the kill, every process exits by itself, and none of the
  job's processes is left on a GPU (on one host, on chorus's kernels and on NCCL's through
  the hand-off, and on two simulated hosts whose all_reduce crosses NCCL rails);
* rank 1 all-gathers where the others all-reduce: CollectiveMismatchError on every rank,
  naming both calls, within seconds (the group's timeout is 60 s), at the op's
  ``Work.synchronize()``, at the next CUDA call and at the next CPU call of the group.
  Sized so that the all_gather is the group's first op handed to NCCL while the
  all_reduce stays on chorus's kernels: the barrier in front of NCCL's kernel meets the
  kernels' barrier, and the communicator is never made.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from ports import free_port  # noqa: E402

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip(f"needs 2 CUDA GPUs (this machine has {torch.cuda.device_count()})", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install 'chorus[cuda]')")
pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed (pip install 'chorus[cuda]')")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORLD = min(4, torch.cuda.device_count())
LIMIT_S = 150  # a worker still running after this dumps its stacks and exits (faulthandler)




@pytest.fixture
def job(tmp_path):
    """Start a scenario's WORLD processes; whatever is still running at the end is killed."""
    procs: list[subprocess.Popen] = []

    def start(scenario: str) -> list[subprocess.Popen]:
        port = free_port()
        for rank in range(WORLD):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                       NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1",
                       PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
            log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
            procs.append(subprocess.Popen(
                [sys.executable, os.path.join(HERE, "failure_workers.py"), scenario, str(rank), str(WORLD),
                 str(tmp_path), str(LIMIT_S)], env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
            log.close()
        return procs

    yield start
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)


def logs(tmp_path) -> str:
    return "\n".join(f"--- rank {r}:\n{(tmp_path / f'rank{r}.log').read_text()[-3000:]}" for r in range(WORLD))


def wait_exit(procs, deadline: float, tmp_path) -> None:
    for rank, p in enumerate(procs):
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.kill(p.pid, signal.SIGUSR1)  # its threads' stacks, into its log
                time.sleep(2)
            except ProcessLookupError:
                pass
            pytest.fail(f"rank {rank} (pid {p.pid}) did not exit by itself\n{logs(tmp_path)}")


def gpu_pids() -> set[int] | None:
    """The pids nvidia-smi lists on the GPUs (None without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return {int(word) for word in out.stdout.split() if word.strip().isdigit()}


def assert_gone(procs) -> None:
    """None of the job's processes is left on a GPU (the driver may take a moment to let a
    dead process's context go)."""
    mine = {p.pid for p in procs}
    deadline = time.monotonic() + 20
    while True:
        left = gpu_pids()
        if left is None or not left & mine:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"job processes still on a GPU: {sorted(left & mine)}")
        time.sleep(0.5)


def read(tmp_path, rank: int) -> dict:
    return json.loads((tmp_path / f"rank{rank}.json").read_text())


@pytest.mark.parametrize("hosts, elements, across", [(None, 1 << 20, None), (None, 16 << 20, None),
                                                     ("a,a,b,b", 16 << 20, "rails"), ("a,a,b,b", 16 << 20, "flat")],
                         ids=["one-host-kernels", "one-host-nccl", "two-hosts-rails", "two-hosts-flat"])
def test_sigkill_mid_all_reduce(hosts, elements, across, job, tmp_path, monkeypatch):
    """one-host-kernels: 4 MiB all_reduces on chorus's two-shot kernels (their spins see
    ABORT); one-host-nccl: 64 MiB, on NCCL's kernels through chorus's hand-off (the
    communicator is aborted); two simulated hosts of two GPUs, all_reduce as the phases
    with the NCCL rails between the hosts (two-hosts-rails) or on one NCCL communicator
    over the whole group (two-hosts-flat): chorus.cuda.rails aborts them."""
    if WORLD < 4:
        pytest.skip(f"kills rank 2 of 4 (two simulated hosts of two GPUs); this machine has {WORLD} GPUs")
    monkeypatch.setenv("KILL_TEST_ELEMENTS", str(elements))
    if hosts:
        monkeypatch.setenv("CHORUS_HOST_ID", hosts)
        monkeypatch.setenv("CHORUS_CUDA_RAILS", "nccl")
        monkeypatch.setenv("CHORUS_CUDA_RAILS_ALL_REDUCE", across)
    procs = job("kill")
    deadline = time.monotonic() + 120
    while True:  # every rank past its first 3 (checked) all_reduces
        done = []
        for r in range(WORLD):
            try:
                done.append(int((tmp_path / f"progress{r}").read_text()))
            except (OSError, ValueError):
                done.append(0)
        if min(done) >= 3:
            break
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            pytest.fail(f"the loop did not get going (iterations {done})\n{logs(tmp_path)}")
        time.sleep(0.05)
    time.sleep(0.3)  # mid-loop
    killed_at = time.time()
    os.kill(procs[2].pid, signal.SIGKILL)
    wait_exit(procs, time.monotonic() + 60, tmp_path)
    assert procs[2].returncode == -signal.SIGKILL
    for r in (0, 1, 3):
        res = read(tmp_path, r)
        assert res["error"] == "PeerLostError", (r, res, logs(tmp_path))
        assert res["lost_rank"] == 2, (r, res)
        assert res["at"] - killed_at <= 5.0, f"rank {r} raised {res['at'] - killed_at:.2f} s after the kill"
        assert res["iterations"] >= 3 and "left_at" in res, (r, res)
        # Through NCCL rails a survivor whose NCCL kernel waited for the dead rank may end,
        # after its PeerLostError and destroy_process_group, in NCCL's teardown: SIGABRT
        # (std::terminate), as torch's own NCCL backend ends such a process; never a hang
        ended = (0, -signal.SIGABRT) if hosts else (0,)
        assert procs[r].returncode in ended, (r, procs[r].returncode, logs(tmp_path))
    assert_gone(procs)


def test_mismatched_collectives_fail_every_rank(job, tmp_path):
    procs = job("mismatch")
    wait_exit(procs, time.monotonic() + 120, tmp_path)
    for r in range(WORLD):
        res = read(tmp_path, r)
        for where in ("work", "next_cuda", "next_cpu"):
            assert res[where]["error"] == "CollectiveMismatchError", (r, where, res, logs(tmp_path))
        assert res["work"]["at"] - res["start"] < 10, (r, res)  # seconds, not the 60 s timeout
        text = res["work"]["message"]
        assert "all_gather" in text and "all_reduce" in text, text  # both calls are named
        if r == 1:
            assert "this rank (rank 1) called all_gather" in text, text
        else:
            assert "rank 1 called all_gather" in text and f"this rank (rank {r}) called all_reduce" in text, text
        assert procs[r].returncode == 0, (r, logs(tmp_path))
    assert_gone(procs)
