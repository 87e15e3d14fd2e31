"""One benchmark rank: joins a chorus job and (if torch is installed) a gloo job, and
times every size on both, alternating, so both see the same machine state."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from chorus.bench.ops import make_case
from chorus.bench.report import Row


def _time(api: Any, reset, step, check, iters: int, warmup: int) -> tuple[float, int]:
    """Mean seconds per step over ``iters`` (inputs reset and results checked between
    steps, untimed), and the total number of wrong elements."""
    for _ in range(warmup):
        reset()
        step()
    api.barrier()
    total, wrong = 0.0, 0
    for _ in range(iters):
        reset()
        start = time.perf_counter()
        step()
        total += time.perf_counter() - start
        wrong += check()
    api.barrier()
    return total / iters, wrong


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
    op = "sum" if cfg["collective"] in ("all_reduce", "reduce", "reduce_scatter") else "none"
    rows = []
    for library, api in apis.items():  # warm both libraries up before the first timed size
        reset, step, _ = make_case(api, library, cfg["collective"], 256, cfg["dtype"], rank, world)
        for _ in range(50):
            reset()
            step()
    for nbytes in cfg["sizes"]:
        count = nbytes // itemsize
        for library, api in apis.items():
            try:
                case = make_case(api, library, cfg["collective"], count, cfg["dtype"], rank, world)
                seconds, wrong = _time(api, *case, cfg["iters"], cfg["warmup"])
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                if library == "chorus":
                    raise
                print(f"# {library} cannot run {cfg['collective']}: {exc}".splitlines()[0])
                continue
            rows.append(Row(library, cfg["collective"], count * itemsize, count, cfg["dtype"], op,
                            seconds, wrong, world))
    if rank == 0:
        with open(os.path.join(workdir, "rows.json"), "w") as f:
            json.dump([asdict(r) for r in rows], f)
    for api in apis.values():
        api.destroy_process_group()
