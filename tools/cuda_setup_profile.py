"""Where a group's first CUDA all_reduce spends its time: the CUDA component's attach
(imports, the workspace's allocation, exchange, mapping and check, the first kernels'
loading through Triton), under cProfile on rank 0 of WORLD processes (one per GPU).

Writes OUT: the first all_reduce's wall time, then cProfile's 45 costliest functions by
cumulative time and 25 by own time.  Run it a second time for a warm Triton cache
(~/.triton): the first run on a machine compiles the kernels.

usage: python3 tools/cuda_setup_profile.py OUT [WORLD]
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import tempfile
import time


def rank_main(rank: int, world: int, rendezvous: str, out: str) -> None:
    import torch

    import chorus

    torch.cuda.set_device(rank)
    chorus.init_process_group("chorus", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    x = torch.ones(16, device="cuda")
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    started = time.perf_counter()
    if rank == 0:
        profile.enable()
    chorus.all_reduce(x)
    torch.cuda.synchronize()
    if rank == 0:
        profile.disable()
        took = time.perf_counter() - started
        by_total, by_own = io.StringIO(), io.StringIO()
        pstats.Stats(profile, stream=by_total).sort_stats("cumulative").print_stats(45)
        pstats.Stats(profile, stream=by_own).sort_stats("tottime").print_stats(25)
        with open(out, "w") as f:
            f.write(f"first all_reduce {took:.3f} s\n{by_total.getvalue()}{by_own.getvalue()}")
    chorus.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    world = int(argv[1]) if len(argv) > 1 else 4
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(world, os.path.join(tmp, "rendezvous"), argv[0]), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
