"""torch's FSDP2 (``fully_shard``) on GPUs with chorus as the backend, over
``init_device_mesh("cuda", (world,))``, on 2 GPUs (``init_process_group("cpu:chorus,cuda:chorus")``)
and 4 (``init_process_group("chorus")``): 5 SGD steps of a small MLP give the losses and
final parameters of a single-GPU run of the same model on the whole batch
(tests/gpu/fsdp_workers.py).

Tolerance: losses within rel 1e-5 / abs 1e-6, parameters within 1e-5 absolute.  Both runs
are fp32 (TF32 off) and compute the same sums in different orders — per-rank means of 8
samples, reduce-scattered in rank order and divided by the world size, against one mean
over all samples — so they differ by a few fp32 roundings per step (~1e-7 relative); a
block gathered or reduced in the wrong place is off by orders of magnitude more."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip(f"needs 2+ CUDA GPUs (this machine has {torch.cuda.device_count()})", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install 'chorus[cuda]')")
pytest.importorskip("torch.distributed.fsdp", reason="this torch has no FSDP2")

import fsdp_workers  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from ports import free_port  # noqa: E402

CASES = [(2, "cpu:chorus,cuda:chorus"), (4, "chorus")]


@pytest.mark.parametrize(("world", "backend"), [c for c in CASES if c[0] <= torch.cuda.device_count()])
def test_fsdp2_matches_single_gpu(world, backend, tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    mp.spawn(fsdp_workers.run, args=(world, backend, free_port(), str(tmp_path)), nprocs=world)
    for rank in range(world):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "chorus" in r["mesh_backend"], r["mesh_backend"]
        assert len(r["losses"]) == fsdp_workers.STEPS
        for mine, single in zip(r["losses"], r["single_losses"], strict=True):
            assert math.isclose(mine, single, rel_tol=1e-5, abs_tol=1e-6), (rank, r["losses"], r["single_losses"])
        assert r["max_param_diff"] <= 1e-5, (rank, r["max_param_diff"])
        assert r["gather_into_view"], rank
