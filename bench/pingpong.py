"""Blocking send/recv ping-pong between two ranks: wall time and the sending rank's
main-thread CPU time per round trip (the CPU figure is steadier on a shared machine).

usage: python3 bench/pingpong.py [ROUND_TRIPS] [ELEMENTS]   (default 5000 round trips of 1 float32)

Used for the point-to-point overhead figures in docs/benchmarks.md; run it alternately
against two checkouts (PYTHONPATH) to compare them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np


def rank_main(rank: int, rounds: int, elements: int, rdzv: str, out) -> None:
    import chorus as dist

    dist.init_process_group("chorus", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    x, peer = np.ones(elements, np.float32), 1 - rank
    for _ in range(100):  # warm-up
        dist.send(x, peer) if rank == 0 else dist.recv(x, peer)
        dist.recv(x, peer) if rank == 0 else dist.send(x, peer)
    dist.barrier()
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
    if rank == 0:
        out.put(((time.perf_counter() - wall) / rounds, (time.thread_time() - cpu) / rounds))
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    rounds = int(argv[0]) if argv else 5000
    elements = int(argv[1]) if len(argv) > 1 else 1
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rdzv = os.path.join(tmp, "rdzv")
        procs = [ctx.Process(target=rank_main, args=(r, rounds, elements, rdzv, results)) for r in range(2)]
        for p in procs:
            p.start()
        wall, cpu = results.get(timeout=600)
        for p in procs:
            p.join()
    print(f"round trip {wall * 1e6:.1f} us; rank 0 main-thread CPU {cpu * 1e6:.1f} us "
          f"({rounds} round trips of {elements * 4} bytes)")
    return max(p.exitcode or 0 for p in procs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
