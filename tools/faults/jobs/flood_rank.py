"""A rank of the flood campaign (tools/faults/flood.py): sets up (under attack), runs
checked collectives, waits ``hold`` seconds (rank 0: while the slow connections are cut),
and writes ``<out>/rank<r>.json``: set-up time, wrong results, its threads and
descriptors over time, and what chorus logged about the attack.

usage: flood_rank.py OUT OPS HOLD_S   (torchrun's variables: RANK, WORLD_SIZE, MASTER_*)
"""

import json
import logging
import os
import sys
import time

import numpy as np
from sampler import Sampler

import chorus as dist

out, ops, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
report = open(os.path.join(out, f"rank{rank}.json"), "w")  # now: later, a flood may leave no descriptor
sampler = Sampler()
logged: dict[str, int] = {}


class Count(logging.Handler):
    """chorus's warnings about connections, by what they say."""

    KINDS = {"out of file descriptors": "out of descriptors", "shedding the oldest": "started shedding",
             "no complete handshake": "transport: cut at the handshake deadline",
             "no handshake within": "store: cut at the handshake deadline",
             "rejected a transport connection": "transport: rejected"}

    def emit(self, record):
        text = record.getMessage()
        kind = next((k for what, k in self.KINDS.items() if what in text), "other")
        logged[kind] = logged.get(kind, 0) + 1


logging.getLogger("chorus").addHandler(Count())
result = {"rank": rank, "ok": False, "wrong": 0, "ops": 0}
try:
    began = time.monotonic()
    dist.init_process_group("gloo", timeout=float(os.environ.get("FLOOD_TIMEOUT", "600")))
    result["setup_s"] = round(time.monotonic() - began, 2)
    total = world * (world + 1) / 2
    for i in range(ops):
        x = np.full(1024, rank + 1, np.float32)
        dist.all_reduce(x)
        y = np.full(16, i if rank == i % world else -1, np.int64)
        dist.broadcast(y, src=i % world)
        result["wrong"] += int(not (x == total).all()) + int(not (y == i).all())
        result["ops"] += 2
    if rank == 0:
        time.sleep(hold)
    dist.barrier()
    dist.destroy_process_group()
    result["ok"] = True
except Exception as exc:  # noqa: BLE001 - reported in the result
    result["error"] = f"{type(exc).__name__}: {exc}"
result.update(sampler.stop(), logged=logged)
json.dump(result, report)
report.close()
