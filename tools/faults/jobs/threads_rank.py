"""A rank of the threads campaign (tools/faults/threads.py): two threads each call
all_reduce ``OPS`` times on the one default group, calling again when refused
(ConcurrentCallError); every result that comes back must be a whole sum of one call per
rank.  Writes ``<out>/rank<r>.json``.

usage: threads_rank.py OUT OPS COUNT   (torchrun's variables: RANK, WORLD_SIZE, MASTER_*)
"""

import itertools
import json
import os
import sys
import threading

import numpy as np

import chorus as dist

out, ops, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
THREADS = 2


def value(r: int, t: int) -> float:
    return float(10 ** r * (t + 1))  # distinct sums for every choice of one thread per rank


sums = {sum(value(r, t) for r, t in enumerate(pick)) for pick in itertools.product(range(THREADS), repeat=world)}
result = {"rank": rank, "returned": 0, "wrong": 0, "refused": 0, "errors": []}
lock = threading.Lock()


def worker(t: int) -> None:
    x = np.empty(count, np.float32)
    for _ in range(ops):
        while True:
            x[:] = value(rank, t)
            try:
                dist.all_reduce(x)
            except dist.ConcurrentCallError:
                with lock:
                    result["refused"] += 1
                os.sched_yield()  # the other thread is inside: let it run
                continue
            except Exception as exc:  # noqa: BLE001 - reported
                with lock:
                    result["errors"].append(f"{type(exc).__name__}: {exc}")
                return
            break
        ok = float(x[0]) in sums and bool((x == x[0]).all())
        with lock:
            result["returned"] += 1
            result["wrong"] += int(not ok)


dist.init_process_group("gloo", timeout=60)
threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
for th in threads:
    th.start()
for th in threads:
    th.join()
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
