"""A rank of the soak campaign (tools/faults/soak.py): random collectives and
point-to-point ops, each result checked, until rank 0's clock says ``SECONDS`` passed.
Every rank draws the same ops from one seed.  It writes its pid to ``<out>/pid.<r>``;
each second it appends "seconds descriptors threads ops wrong" to ``<out>/samples.<r>``
(so a killed rank leaves its series), and at the end writes ``<out>/rank<r>.json``: ops
done, wrong results, its error if any.

As a script (ranks started by hand): ``soak_rank.py OUT SECONDS SEED``.
As a module: ``job(rank, world, out, seconds, seed, port)`` for chorus.spawn.
"""

import json
import os
import random
import sys
import threading
import time

import numpy as np
from rounds import rounds

SIZES = (1, 333, 4096, 65536, 262144)  # elements
DTYPES = (np.float32, np.float64, np.int64)


def _sample(out: str, rank: int, result: dict, stop: threading.Event) -> None:
    start = time.monotonic()
    with open(os.path.join(out, f"samples.{rank}"), "a") as f:
        while not stop.is_set():
            f.write(f"{time.monotonic() - start:.1f} {len(os.listdir('/proc/self/fd'))} "
                    f"{len(os.listdir('/proc/self/task'))} {result['ops']} {result['wrong']}\n")
            f.flush()
            stop.wait(1.0)


def _one(dist, rng: random.Random, i: int, rank: int, w: int) -> bool:
    """Run one random op; True if its result is right."""
    kind = rng.choice(("all_reduce", "max", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "ring",
                       "reduce", "barrier"))
    n, dtype, root, k = rng.choice(SIZES), rng.choice(DTYPES), rng.randrange(w), i % 7
    if kind in ("all_reduce", "max"):
        x = np.full(n, rank + 1 + k, dtype)
        dist.all_reduce(x, op=dist.ReduceOp.SUM if kind == "all_reduce" else dist.ReduceOp.MAX)
        return bool((x == (w * k + w * (w + 1) // 2 if kind == "all_reduce" else w + k)).all())
    if kind == "broadcast":
        x = np.full(n, i if rank == root else -1, dtype)
        dist.broadcast(x, src=root)
        return bool((x == i).all())
    if kind == "all_gather":
        out = [np.empty(n, dtype) for _ in range(w)]
        dist.all_gather(out, np.full(n, rank + k, dtype))
        return all((o == r + k).all() for r, o in enumerate(out))
    if kind == "reduce_scatter":
        out = np.empty(n, dtype)
        dist.reduce_scatter(out, [np.full(n, rank + j, dtype) for j in range(w)])
        return bool((out == w * rank + w * (w - 1) // 2).all())
    if kind == "all_to_all":
        out = np.empty(w * n, dtype)
        dist.all_to_all_single(out, np.repeat(np.arange(w, dtype=dtype) + w * rank, n))
        return bool((out == np.repeat(np.arange(w, dtype=dtype) * w + rank, n)).all())
    if kind == "ring":  # point-to-point: to the next rank, from the previous
        got = np.empty(n, dtype)
        sent = dist.isend(np.full(n, rank + k, dtype), dst=(rank + 1) % w)
        dist.recv(got, src=(rank - 1) % w)
        sent.wait()
        return bool((got == (rank - 1) % w + k).all())
    if kind == "reduce":
        x = np.full(n, rank + 1, dtype)
        dist.reduce(x, dst=root)
        return bool((x == (w * (w + 1) // 2 if rank == root else rank + 1)).all())
    dist.barrier()
    return True


def job(rank: int, world: int, out: str, seconds: float, seed: int, port: int | None = None) -> None:
    if port is not None:  # under chorus.spawn: rendezvous on the port the campaign picked
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with open(os.path.join(out, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    stop = threading.Event()
    result = {"rank": rank, "ops": 0, "wrong": 0}
    threading.Thread(target=_sample, args=(out, rank, result, stop), daemon=True).start()
    import chorus as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=30)
        rng = random.Random(seed)
        for _ in rounds(dist, seconds):
            result["wrong"] += int(not _one(dist, rng, result["ops"], rank, world))
            result["ops"] += 1
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported
        result["error"] = f"{type(exc).__name__}: {exc}"[:300]
    stop.set()
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)  # whole or absent, even if the rank is killed meanwhile
    if "error" in result:
        sys.exit(1)


if __name__ == "__main__":
    job(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
