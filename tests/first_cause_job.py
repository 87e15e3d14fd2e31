"""A job in which rank 1 raises ValueError while the other ranks wait for it in an
all_reduce: whichever launcher runs it must report rank 1's ValueError.

As a module: ``job(rank, world, init_method)`` for ``chorus.spawn`` and
``torch.multiprocessing.spawn``.  As a script: ``chorusrun ... first_cause_job.py [--catch]``.
"""

import os
import sys

import numpy as np

import chorus as dist

MESSAGE = "bad input on rank 1"


def job(rank: int, world: int, init_method: str | None = None, catch: bool = False) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    dist.barrier()
    if rank == 1:
        raise ValueError(MESSAGE)
    t = np.ones(4)
    try:
        dist.all_reduce(t)  # rank 1 never joins: PeerLostError here
    except dist.PeerLostError as e:
        if not catch:
            raise
        print(f"rank {rank} caught: {e}", flush=True)


if __name__ == "__main__":  # --catch: the other ranks print their error and exit 0
    job(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), catch="--catch" in sys.argv)
