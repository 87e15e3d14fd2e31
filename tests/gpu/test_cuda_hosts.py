"""Groups spanning hosts, on 4 GPUs of one machine: ``CHORUS_HOST_ID=a,a,b,b`` makes ranks
0-1 and 2-3 two simulated hosts.  The CUDA component must not map peers' memory across
hosts: it stages CUDA tensors through pinned host memory into chorus's hierarchical CPU
path (shared memory inside each host, TCP between them), and every collective and
point-to-point op of a seeded random program gives NCCL's results bit for bit
(tests/gpu/hosts_workers.py)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 4:
    pytest.skip(f"needs 4 CUDA GPUs (this machine has {torch.cuda.device_count()})", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install 'chorus[cuda]')")

import hosts_workers  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from ports import free_port  # noqa: E402

STEPS = 40




def test_two_hosts_stage_and_match_nccl(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("CHORUS_HOST_ID", "a,a,b,b")
    monkeypatch.setenv("CHORUS_CUDA_RAILS", "off")
    mp.spawn(hosts_workers.run, args=(4, free_port(pair=True), STEPS, 4321, str(tmp_path)), nprocs=4)
    for rank in range(4):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["staged"] and "several hosts" in r["reason"], (rank, r["reason"])
        assert r["component"] == "CudaComponent", rank
        assert r["hierarchical"], rank
        assert r["first_sum_right"], rank
        assert r["wrong"] == [], (rank, r["wrong"])


@pytest.mark.parametrize("kind, host_nccl_from, all_reduce", [
    ("nccl", None, "rails"), ("nccl", "4096", "rails"), ("tcp", None, "rails"), ("nccl", None, "flat")])
def test_two_hosts_rails_match_nccl(kind, host_nccl_from, all_reduce, tmp_path, monkeypatch):
    """all_reduce as the rails' phases: chorus inside each simulated host (its kernels; or,
    from ``host_nccl_from`` bytes, a host NCCL communicator) and the rails between them
    (NCCL, or chorus's TCP path staged); or ``all_reduce="flat"``: one NCCL all_reduce over
    the whole group.  Broadcast on the rails; with NCCL rails, all_gather, reduce_scatter
    and all_to_all on the whole group's NCCL communicator; the rest staged.  The same
    random program, bit for bit against a flat NCCL group."""
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("CHORUS_HOST_ID", "a,a,b,b")
    monkeypatch.setenv("CHORUS_CUDA_RAILS", kind)
    monkeypatch.setenv("CHORUS_CUDA_RAILS_ALL_REDUCE", all_reduce)
    if host_nccl_from is not None:
        monkeypatch.setenv("CHORUS_CUDA_NCCL_GATHER_FROM_BYTES", host_nccl_from)
    mp.spawn(hosts_workers.run, args=(4, free_port(pair=True), STEPS, 4321, str(tmp_path)), nprocs=4)
    for rank in range(4):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (r["component"], r["rails"]) == ("RailsComponent", kind), (rank, r)
        assert r["second_sum_right"], rank
        assert r["host_nccl"] == (host_nccl_from is not None), (rank, r)  # (256 KiB: on NCCL from 4096 bytes)
        assert r["gather_right"], rank
        assert r["flat_nccl"] == (kind == "nccl"), (rank, r)  # (all_gather: on it whenever the rails are NCCL's)
        assert r["first_all_reduce_flat"] == (kind == "nccl" and all_reduce == "flat"), (rank, r)
        assert r["first_sum_right"], rank
        assert r["wrong"] == [], (rank, r["wrong"])
