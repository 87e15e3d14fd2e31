"""What one all_reduce call costs this process's CPU, with no peer to wait for: a group
of one rank (its shared-memory window has one slot; every sync finds everyone arrived)
runs all_reduce in a loop, and each time per call is the best of several rounds.

Rows: the latency path one-shot (numpy array; torch CPU tensor when torch is installed),
and reduce-scatter + all-gather in one chunk on the latency path and on the general path
(a Call, its components, the pipeline of chorus.shm.phases).  A group of one rank would
run neither of the last two, so for them this script changes two of
chorus.shm.collectives' module constants in its own process: ``one_shot`` answers False
and ``WHOLE_CHUNKS_WORLD`` is 0, and for the general path's row it marks the shape as
unplanned in the latency path's cache, which then steps aside.  At W ranks a call costs about this plus the
waits and the reads of the peers' data.

usage: python3 tools/call_cost.py [ITERS] [ROUNDS] [--json FILE]
  e.g. PYTHONPATH=$PWD python3 tools/call_cost.py 3000 5
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import numpy as np

SIZES = (4, 1024, 16 << 10, 64 << 10, 256 << 10)


def _best(fn, iters: int, rounds: int) -> float:
    """Least microseconds per call of ``fn`` over ``rounds`` rounds of ``iters`` calls."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e6


def main(argv: list[str]) -> int:
    out = None
    if "--json" in argv:
        i = argv.index("--json")
        out = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    iters, rounds = ([int(a) for a in argv] + [3000, 5][len(argv):])[:2]
    import chorus as dist
    from chorus.shm import collectives as algo

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(rank=0, world_size=1)
    lane = dist.group.WORLD.lane
    rows = []
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        row = {"bytes": nbytes, "one_shot_numpy_us": _best(lambda x=x: dist.all_reduce(x), iters, rounds)}
        try:
            import torch

            t = torch.ones(nbytes // 4)
            row["one_shot_torch_us"] = _best(lambda t=t: dist.all_reduce(t), iters, rounds)
        except ImportError:
            pass
        rows.append(row)
    one_shot, whole = algo.one_shot, algo.WHOLE_CHUNKS_WORLD
    algo.one_shot, algo.WHOLE_CHUNKS_WORLD = (lambda *a, **k: False), 0
    lane.forget_plans()
    try:
        for row in rows:
            x = np.ones(row["bytes"] // 4, np.float32)
            row["two_shot_lane_us"] = _best(lambda x=x: dist.all_reduce(x), iters, rounds)

            y = x.reshape(-1, 1)

            def general(y=y) -> None:
                lane.last_reduce = None
                lane.plans[(y.dtype, y.shape, "SUM")] = False  # the latency path steps aside
                dist.all_reduce(y)
            row["two_shot_general_us"] = _best(general, max(1, iters // 4), rounds)
    finally:
        algo.one_shot, algo.WHOLE_CHUNKS_WORLD = one_shot, whole
        lane.forget_plans()
    dist.destroy_process_group()
    keys = [k for k in rows[0] if k != "bytes"]
    print(f"# us per all_reduce call, one rank, best of {rounds} rounds of {iters} calls")
    print(f"{'bytes':>8} " + " ".join(f"{k:>22}" for k in keys))
    for row in rows:
        print(f"{row['bytes']:>8} " + " ".join(f"{row.get(k, float('nan')):>22.2f}" for k in keys))
    if out:
        with open(out, "w") as f:
            json.dump({"iters": iters, "rounds": rounds, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
