"""Small all_reduce of torch CPU tensors against numpy arrays in the same job: W processes
(chorus.spawn) call ``all_reduce`` in a loop on a float32 buffer of each kind, the kinds
alternating round by round; rank 0 prints, per size, the best round's time per op of
each kind and their ratio.  Needs torch.

usage: python3 tools/torch_latency.py [W] [ITERS] [ROUNDS]
  e.g. python3 tools/torch_latency.py 2 20000 5
"""

from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np

SIZES = (1, 1024)  # elements: 4 B and 4 KiB


def _rank(rank: int, world: int, port: int, iters: int, rounds: int) -> None:
    import torch

    import chorus as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(rank=rank, world_size=world)
    lines = []
    for n in SIZES:
        buffers = {"numpy": np.full(n, rank + 1, np.float32), "torch": torch.full((n,), rank + 1.0)}
        best = {kind: float("inf") for kind in buffers}
        for _ in range(rounds):
            for kind, data in buffers.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(data)
                best[kind] = min(best[kind], (time.perf_counter() - start) / iters)
        lines.append(f"{n * 4:>6} B  numpy {best['numpy'] * 1e6:7.2f} us  torch {best['torch'] * 1e6:7.2f} us  "
                     f"torch / numpy {best['torch'] / best['numpy']:.2f}")
    if rank == 0:
        print(f"W={world}, {iters} ops a round, best of {rounds} rounds a kind, torch {torch.__version__}")
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    world = int(argv[0]) if argv else 2
    iters = int(argv[1]) if len(argv) > 1 else 20000
    rounds = int(argv[2]) if len(argv) > 2 else 5
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import chorus

    chorus.spawn(_rank, args=(world, port, iters, rounds), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
