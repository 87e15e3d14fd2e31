"""Two NCCL communicators on the same GPUs, timed against each other: torch's default
group (``init_process_group("nccl", device_id=...)``, as chorus bench's baseline makes
it; ``dist.all_reduce``, synchronous: NCCL's kernel on the current stream) and a
``ProcessGroupNCCL`` made over a TCPStore the way chorus.cuda.nccl makes the
communicator it hands large all_reduces to, called two ways: ``twin`` with torch's
default options (asyncOp on: NCCL's own stream, an event each way, then ``wait()``) and
``twin-sync`` with asyncOp off (chorus.cuda.nccl.on_current_stream).  Whether a gap
between chorus's hand-off and NCCL comes from the communicator, from the stream it runs
on, or from chorus's calls around it.  Each round times each variant at each size
(back-to-back all_reduces between two CUDA events, the order turning round by round).
One process per GPU; rank 0 prints a table and the per-round ratios.

usage: python3 tools/nccl_twin.py [ROUNDS] [ITERS] [SIZES]   (SIZES: bytes, comma-separated)
"""

from __future__ import annotations

import os
import statistics
import sys
from datetime import timedelta
from functools import partial

import torch
import torch.multiprocessing as mp
from cuda_handoff_parts import gpu_call

SIZES = (8 << 20, 16 << 20, 32 << 20)


def body(rank: int, world: int, port: int, rounds: int, iters: int, sizes: list[int]) -> None:
    import torch.distributed as tdist

    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                             device_id=torch.device("cuda", rank))
    store = tdist.TCPStore("127.0.0.1", port + 1, world, rank == 0, timedelta(seconds=60))
    twin = tdist.ProcessGroupNCCL(store, rank, world)
    opts, sync = tdist.AllreduceOptions(), tdist.AllreduceOptions()
    opts.reduceOp = sync.reduceOp = tdist.ReduceOp.SUM
    sync.asyncOp = False

    def twin_sync(t) -> None:
        work = twin.allreduce([t], sync)
        if work is not None:  # (torch makes no Work for a synchronous op)
            work.wait()

    calls = {"default": lambda t: tdist.all_reduce(t),
             "twin": lambda t: twin.allreduce([t], opts).wait(),
             "twin-sync": twin_sync}
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for size in sizes:
            t = torch.ones(size // 2, dtype=torch.bfloat16, device="cuda")
            names = list(calls)
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                tdist.barrier()
                times.setdefault((name, size), []).append(gpu_call(partial(calls[name], t), iters, held=False))
    if rank == 0:
        print(f"# nccl_twin: {world} GPUs ({torch.cuda.get_device_name(0)}), torch {torch.__version__}, "
              f"bf16 all_reduce, {iters} back-to-back calls a timing, {rounds} rounds (the order turning)")
        print(f"{'size':>6} {'variant':>10} {'us':>8} {'/default':>9}   each round (variant / default)")
        for size in sizes:
            d = times[("default", size)]
            for name in calls:
                v = times[(name, size)]
                each = " ".join(f"{b / a:.3f}" for a, b in zip(d, v, strict=True))
                print(f"{size >> 20:>5}M {name:>10} {statistics.median(v):>8.1f} "
                      f"{statistics.median(v) / statistics.median(d):>9.3f}   {each}")
    tdist.barrier()
    if hasattr(twin, "shutdown"):
        twin.shutdown()
    tdist.destroy_process_group()


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    sizes = [int(s) for s in sys.argv[3].split(",")] if len(sys.argv) > 3 else list(SIZES)
    world = torch.cuda.device_count()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(body, args=(world, 29650, rounds, iters, sizes), nprocs=world)


if __name__ == "__main__":
    main()
