"""The job the kills campaign (tools/faults/kills.py) kills: every rank notes its pid,
sets up, then for ``SECONDS`` (rank 0's clock) runs all_reduces (small and 1 MiB), 512 KiB sends between
ranks 0 and 1 (through the same-host rings), and a new group every few rounds (a new
shared-memory window); a rank that fails notes why.

As a script (torchrun, or ranks started by hand): ``kill_job.py OUT SECONDS TIMEOUT``.
As a module: ``job(rank, world, out, seconds, timeout, port)`` for chorus.spawn and mp.spawn.
"""

import os
import sys

import numpy as np
from rounds import rounds


def job(rank: int, world: int, out: str, seconds: float, timeout: float, port: int | None = None) -> None:
    with open(os.path.join(out, f"pid.{rank}"), "w") as f:
        f.write(f"{os.getpid()}\n")
    if port is not None:  # under a spawn: rendezvous on the port the launcher picked
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import chorus as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        open(os.path.join(out, f"ready.{rank}"), "w").close()
        small, big, pair = np.ones(16, np.float32), np.ones(1 << 18, np.float32), np.empty(1 << 17, np.float32)
        for n in rounds(dist, seconds):
            dist.all_reduce(small)
            dist.all_reduce(big)
            if rank == 0:
                dist.send(pair, dst=1)
            elif rank == 1:
                dist.recv(pair, src=0)
            if n % 5 == 4:
                g = dist.new_group(list(range(world)))
                dist.all_reduce(small, group=g)
                dist.destroy_process_group(g)
        dist.destroy_process_group()
    except Exception as exc:
        with open(os.path.join(out, f"error.{rank}"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}"[:500])
        raise


if __name__ == "__main__":
    job(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[1], float(sys.argv[2]), float(sys.argv[3]))
