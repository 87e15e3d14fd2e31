"""Starting the W rank processes of a bench script (bench/ab_probe.py, bench/iter_times.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable


def spawn(rank_main: Callable[..., None], world: int, outdir: str, *args) -> int:
    """Run ``rank_main(rank, world, *args)`` in W spawned processes, after removing the
    rendezvous files of an earlier run from ``outdir``; the worst exit code."""
    os.makedirs(outdir, exist_ok=True)
    for name in ("chorus.rdzv", "gloo.rdzv"):
        if os.path.exists(os.path.join(outdir, name)):
            os.unlink(os.path.join(outdir, name))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(p.exitcode or 0 for p in procs)
