"""``import chorus as dist`` on CUDA tensors, through the API, against torch's NCCL: a seeded
random program of every collective and point-to-point op (all dtypes, sub-groups, sizes of
1 element to 1 Mi elements, uneven all_to_all) on 2, 3 and 4 GPUs, results identical."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if torch.cuda.device_count() < 2:
    pytest.skip(f"needs 2+ CUDA GPUs (this machine has {torch.cuda.device_count()})", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install 'chorus[cuda]')")

import api_workers  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from ports import free_port  # noqa: E402


@pytest.mark.parametrize("world", [w for w in (2, 3, 4) if w <= torch.cuda.device_count()])
def test_random_program_matches_nccl(world, tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    mp.spawn(api_workers.run, args=(world, free_port(pair=True), 60, 1234 + world, str(tmp_path)), nprocs=world)
    wrong = {r: (tmp_path / f"rank{r}.txt").read_text() for r in range(world)}
    assert all(not text for text in wrong.values()), wrong
