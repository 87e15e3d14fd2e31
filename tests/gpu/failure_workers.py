"""What each GPU process of tests/gpu/test_cuda_failures_gpu.py runs (a script, started
with subprocess so that the test knows every pid):

    python failure_workers.py SCENARIO RANK WORLD OUTDIR LIMIT_S

with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set: ``import chorus as dist``,
``dist.init_process_group("nccl")`` (env://), then

    kill      large all_reduces of CUDA tensors in a loop, ``torch.cuda.synchronize()``
              each; the test SIGKILLs rank 2 mid-loop and every other rank must raise
              PeerLostError (the time it caught it goes into the report)
    mismatch  rank 1 calls all_gather_into_tensor where the others call all_reduce (CUDA
              tensors, async_op=True, ``work.synchronize()``): CollectiveMismatchError
              at the call or there, at the next CUDA call, and at the next CPU call of
              the group

Each rank writes what it saw to OUTDIR/rankR.json (and OUTDIR/progressR while looping),
then leaves (destroy_process_group) and exits by itself.  ``faulthandler`` dumps every
thread's stack on SIGUSR1 (the test sends it to a rank that does not exit in time), and
dumps them and exits if a rank is still running after LIMIT_S seconds.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch

import chorus as dist


def write(path: str, data) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def caught(exc: BaseException, **more) -> dict:
    return dict(error=type(exc).__name__, at=time.time(), message=str(exc), **more)


def kill(rank: int, world: int, out: str) -> dict:
    """All-reduce KILL_TEST_ELEMENTS float32 elements (default 16 Mi: 64 MiB, on
    NCCL's kernels through chorus's hand-off; 1 Mi: 4 MiB, chorus's two-shot kernels)
    again and again until something fails."""
    x = torch.empty(int(os.environ.get("KILL_TEST_ELEMENTS", 16 << 20)), device="cuda")
    i = 0
    try:
        while True:
            x.fill_(1.0)
            dist.all_reduce(x)
            torch.cuda.synchronize()
            if i < 3:  # the test kills only after every rank did 3 (right) ones
                assert bool((x == world).all()), f"iteration {i}: wrong sum"
            i += 1
            write(os.path.join(out, f"progress{rank}"), i)
    except dist.PeerLostError as exc:
        return caught(exc, lost_rank=exc.lost_rank, iterations=i)
    except Exception as exc:  # noqa: BLE001 - reported; the test names it
        return caught(exc, iterations=i)


def mismatch(rank: int, world: int, out: str) -> dict:
    x = torch.full((1 << 20,), float(rank), device="cuda")  # 4 MiB: all_reduce on chorus's kernels
    dist.all_reduce(x)  # attaches the CUDA component; a right op first
    torch.cuda.synchronize()
    assert bool((x == sum(range(world))).all())
    n = max(1 << 20, (4 << 20) // world)  # the all_gather's output: 16 MiB or more, NCCL's
    seen = {}
    start = time.time()
    try:  # (the group's first hand-off waits for its barrier, so rank 1 may raise at the call)
        if rank == 1:  # the group's first op handed to NCCL, against the others' kernels
            work = dist.all_gather_into_tensor(torch.empty(world * n, device="cuda"),
                                               torch.ones(n, device="cuda"), async_op=True)
        else:
            work = dist.all_reduce(x, async_op=True)
        work.synchronize()
        seen["work"] = dict(error=None)
    except Exception as exc:  # noqa: BLE001 - reported
        seen["work"] = caught(exc)
    try:
        dist.all_reduce(x)  # the next CUDA call
        seen["next_cuda"] = dict(error=None)
    except Exception as exc:  # noqa: BLE001
        seen["next_cuda"] = caught(exc)
    try:
        dist.all_reduce(torch.ones(4))  # a CPU op of the same group: the transport was told
        seen["next_cpu"] = dict(error=None)
    except Exception as exc:  # noqa: BLE001
        seen["next_cpu"] = caught(exc)
    return dict(start=start, **seen)


def main() -> None:
    scenario, rank, world, out, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
    faulthandler.dump_traceback_later(limit, exit=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=timedelta(seconds=60))
    report = {"kill": kill, "mismatch": mismatch}[scenario](rank, world, out)
    report["pid"] = os.getpid()
    write(os.path.join(out, f"rank{rank}.json"), report)
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - leaving a broken group may complain; it must not hang
        print(f"rank {rank}: destroy_process_group: {type(exc).__name__}: {exc}", flush=True)
    report["left_at"] = time.time()
    write(os.path.join(out, f"rank{rank}.json"), report)


if __name__ == "__main__":
    main()
