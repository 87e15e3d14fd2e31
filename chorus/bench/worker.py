"""One benchmark rank: joins a chorus job and (if torch is installed) a gloo job, and
times every size on both, alternating, so both see the same machine state."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from chorus.bench.ops import expected_recv, make_step
from chorus.bench.report import Row


def _buffers(library: str, count: int, dtype: str, rank: int) -> tuple[Any, Any]:
    if library == "chorus":
        return np.full(count, rank + 1, dtype), np.zeros(count, dtype)
    import torch

    tdtype = getattr(torch, dtype)
    return torch.full((count,), rank + 1, dtype=tdtype), torch.zeros(count, dtype=tdtype)


def _time(api: Any, step, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    api.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    api.barrier()
    return (time.perf_counter() - start) / iters


def _wrong(recv: Any, expect: float | None) -> int:
    if expect is None:
        return 0
    values = recv.numpy() if hasattr(recv, "numpy") and not isinstance(recv, np.ndarray) else recv
    return int(np.count_nonzero(values != expect))


def rank_main(rank: int, cfg: dict, workdir: str) -> None:
    import chorus

    world = cfg["world"]
    apis = {"chorus": chorus}
    chorus.init_process_group("chorus", init_method=f"file://{workdir}/chorus.rdzv", rank=rank, world_size=world)
    if "gloo" in cfg["baselines"]:
        import torch.distributed as tdist

        tdist.init_process_group("gloo", init_method=f"file://{workdir}/gloo.rdzv", rank=rank, world_size=world)
        apis["gloo"] = tdist
    itemsize = np.dtype(cfg["dtype"]).itemsize
    rows = []
    for nbytes in cfg["sizes"]:
        count = nbytes // itemsize
        for library, api in apis.items():
            send, recv = _buffers(library, count, cfg["dtype"], rank)
            step = make_step(api, cfg["collective"], send, recv, rank, world)
            seconds = _time(api, step, cfg["iters"], cfg["warmup"])
            wrong = _wrong(recv, expected_recv(cfg["collective"], rank, world))
            rows.append(Row(library, cfg["collective"], count * itemsize, count, cfg["dtype"], "none",
                            seconds, wrong, world))
    if rank == 0:
        with open(os.path.join(workdir, "rows.json"), "w") as f:
            json.dump([asdict(r) for r in rows], f)
    for api in apis.values():
        api.destroy_process_group()
