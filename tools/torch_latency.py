"""Small all_reduce of torch CPU tensors against numpy arrays in the same job: W processes
(chorus.spawn) call ``all_reduce`` in a loop on a float32 buffer of each kind, and torch's
gloo on the torch tensor in the same processes, the three alternating round by round;
rank 0 prints, per size, the best round's time per op of each and the ratios.
``--load N`` keeps N busy processes (a Python loop each) running meanwhile.  Needs torch.

usage: python3 tools/torch_latency.py [--load N] [W] [ITERS] [ROUNDS]
  e.g. python3 tools/torch_latency.py 2 20000 5; python3 tools/torch_latency.py --load 4 2 2000 5
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np

SIZES = (1, 1024)  # elements: 4 B and 4 KiB


def _rank(rank: int, world: int, ports: tuple[int, int], iters: int, rounds: int) -> None:
    import torch
    import torch.distributed as tdist

    import chorus as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    dist.init_process_group(rank=rank, world_size=world)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=world)
    lines = []
    for n in SIZES:
        runs = {"numpy": (dist, np.full(n, rank + 1, np.float32)), "torch": (dist, torch.full((n,), rank + 1.0)),
                "gloo": (tdist, torch.full((n,), rank + 1.0))}
        best = {kind: float("inf") for kind in runs}
        for _ in range(rounds):
            for kind, (lib, data) in runs.items():
                lib.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    lib.all_reduce(data)
                best[kind] = min(best[kind], (time.perf_counter() - start) / iters)
        us = {k: v * 1e6 for k, v in best.items()}
        lines.append(f"{n * 4:>6} B  chorus numpy {us['numpy']:7.2f} us  chorus torch {us['torch']:7.2f} us  "
                     f"gloo torch {us['gloo']:7.2f} us  torch / numpy {us['torch'] / us['numpy']:.2f}  "
                     f"gloo / chorus torch {us['gloo'] / us['torch']:.2f}")
    if rank == 0:
        print(f"W={world}, {iters} ops a round, best of {rounds} rounds each, torch {torch.__version__}")
        print("\n".join(lines), flush=True)
    tdist.destroy_process_group()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    load = 0
    if argv[:1] == ["--load"]:
        load, argv = int(argv[1]), argv[2:]
    world = int(argv[0]) if argv else 2
    iters = int(argv[1]) if len(argv) > 1 else 20000
    rounds = int(argv[2]) if len(argv) > 2 else 5
    import chorus

    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    try:
        if load:
            print(f"{load} busy processes running meanwhile", flush=True)
        chorus.spawn(_rank, args=(world, (_port(), _port()), iters, rounds), nprocs=world)
    finally:
        for p in busy:
            p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
