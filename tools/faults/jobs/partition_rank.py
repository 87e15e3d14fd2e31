"""A rank of the partition campaign (tools/faults/partition.py): 64 MiB all_reduces in a
loop until one raises; writes ``<out>/ready<r>`` after the first and ``<out>/rank<r>.json``
(the wall-clock time it raised, the error, the ops done) at the end.

usage: partition_rank.py OUT OP_TIMEOUT_S   (RANK, WORLD_SIZE, MASTER_* in the environment)
"""

import json
import os
import sys
import time

import numpy as np

import chorus as dist

out, timeout = sys.argv[1], float(sys.argv[2])
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timeout)
x = np.ones(16 << 20, np.float32)  # 64 MiB
dist.all_reduce(x)
open(os.path.join(out, f"ready{rank}"), "w").close()
ops = 1
try:
    while True:
        dist.all_reduce(x)
        ops += 1
except Exception as exc:  # noqa: BLE001 - the result
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"time": time.time(), "ops": ops, "error": f"{type(exc).__name__}: {exc}"}, f)
    os._exit(3)
