"""``import chorus.torch`` and backend "chorus" on GPUs: DDP (``device_ids=[rank]``) on 4 GPUs
for 20 steps gives NCCL's per-step losses within 1e-4 relative, with identical replicas; a
CUDA op's future is complete at enqueue and its value follows the op on the stream; ops
handed to NCCL asynchronously still run in the group's issue order."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip(f"needs 2+ CUDA GPUs (this machine has {torch.cuda.device_count()})", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install 'chorus[cuda]')")

import ddp_workers  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from ports import free_port  # noqa: E402


def test_ddp_matches_nccl(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    world = min(4, torch.cuda.device_count())
    for backend in ("chorus", "nccl"):
        mp.spawn(ddp_workers.train, args=(world, backend, free_port(), 20, str(tmp_path)), nprocs=world)
    runs = {b: [json.loads((tmp_path / f"{b}-rank{r}.json").read_text()) for r in range(world)]
            for b in ("chorus", "nccl")}
    ours, theirs = runs["chorus"][0]["losses"], runs["nccl"][0]["losses"]
    assert len(ours) == len(theirs) == 20
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(ours, theirs, strict=True)), (ours, theirs)
    sums = runs["chorus"][0]["checksums"]
    assert all(s == sums[0] for s in sums), sums  # every replica holds the same parameters
    total = float(sum(range(1, world + 1)))
    for record in runs["chorus"]:
        assert record["future_done_at_once"], record
        assert record["future_value"] == [total] * 4, record
        assert record["lane_handoffs_in_ddp"] >= 19, record  # the 8 MiB bucket, every step after the first
        assert record["handoffs_async_on_the_lane"] == 2, record
        assert record["handoff_twice"] == [world * world] * 2, record
        assert record["handoff_future_is_the_tensor"], record
        assert record["handoff_then_kernels"] == [world * world, world], record
