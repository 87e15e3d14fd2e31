"""One benchmark rank: joins a chorus job and (if asked) a torch gloo job, and times
every size on both, alternating, so both see the same machine state (and, when MPI is
timed too, taking turns with the MPI job size by size: chorus.bench.turns).

Each rank writes ``<workdir>/rows-<rank>.json``: its rows (its own time and wrong
count) and notes; the parent merges the ranks (rank 0's time, every rank's #wrong).
Rank 0 also records each size as it finishes, for the parent's progress lines
(chorus.bench.progress).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import numpy as np

from chorus.bench import progress
from chorus.bench.ops import WARMUP_OPS, batch_size, iterations, make_cases, op_label, time_case
from chorus.bench.report import Row
from chorus.bench.turns import Turns


def rank_main(rank: int, cfg: dict, workdir: str) -> None:
    os.environ["CHORUS_TRANSPORT"] = cfg["transport"]
    import chorus

    world = cfg["world"]
    apis: dict[str, Any] = {"chorus": chorus}
    chorus.init_process_group("chorus", init_method=f"file://{workdir}/chorus.rdzv", rank=rank, world_size=world)
    if "gloo" in cfg["baselines"]:
        import warnings

        import torch.distributed as tdist

        # torch 2.13 deprecates the *_tensor names that chorus and older torch share.
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated")

        tdist.init_process_group("gloo", init_method=f"file://{workdir}/gloo.rdzv", rank=rank, world_size=world)
        apis["gloo"] = tdist
    collective, dtype, op = cfg["collective"], cfg["dtype"], cfg["op"]
    itemsize = np.dtype(dtype).itemsize
    rows: list[Row] = []
    notes: list[str] = []

    def give_up(library: str, exc: Exception) -> None:
        """A baseline that cannot run this case is dropped (chorus's failures raise)."""
        if library == "chorus":
            raise exc
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        notes.append(f"{library} cannot run {collective} ({dtype}, op {op}): {first_line}")
        del apis[library]

    turns = Turns(workdir if cfg.get("turns") else None, "chorus", rank, cfg.get("parent_pid"))
    turns.wait(0)
    for library, api in list(apis.items()):  # warm every library up before the first size
        try:
            [(reset, step, _)] = make_cases(api, library, collective, 256, dtype, rank, world, op)
            for _ in range(WARMUP_OPS):
                reset()
                step()
        except Exception as exc:
            give_up(library, exc)
    turns.done(0)
    for index, count in enumerate(cfg["counts"], start=1):
        turns.wait(index)
        timed: dict[str, float] = {}
        for library, api in list(apis.items()):
            try:
                iters, warmup = iterations(cfg, collective, count, dtype, world)
                copies = batch_size(collective, count, dtype, world, iters)
                cases = make_cases(api, library, collective, count, dtype, rank, world, op, copies,
                                   registered=cfg.get("registered", False) and library == "chorus")
                seconds, wrong = time_case(api.barrier, cases, iters, warmup)
            except Exception as exc:
                give_up(library, exc)
                continue
            rows.append(Row(library, collective, count * itemsize, count, dtype,
                            op_label(collective, op), seconds, wrong, world))
            timed[library] = seconds
        if rank == 0:
            progress.record(workdir, "chorus", index, timed)
        turns.done(index)
    with open(os.path.join(workdir, f"rows-{rank}.json"), "w") as f:
        json.dump({"rows": [asdict(r) for r in rows], "notes": notes}, f)
    for api in apis.values():
        api.destroy_process_group()
