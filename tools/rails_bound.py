"""What a two-level all_reduce can reach on one 4-GPU host split into two simulated hosts
of two GPUs, with torch's NCCL alone (no chorus): the bound for chorus.cuda.rails.

    hosts a = GPUs 0, 1 and b = GPUs 2, 3; rails [0, 2] and [1, 3]

    flat     torch's all_reduce over the 4 GPUs
    hier1    reduce_scatter in the host, all_reduce of the shard on the rail, all_gather in
             the host, one after the other (what chorus.cuda.rails does)
    hierC    the same in C chunks: the host's phases on one stream and the rail's on
             another, so that chunk k crosses the rail while chunk k+1 is reduced and chunk
             k-1 gathered in the host

Each line: the size, then per variant the GPU time per call (the best of two rounds, CUDA
events around back-to-back calls queued behind a 0.1 s hold), flat's time over it and the
CPU time per call; then how many elements of hier4 differ from flat's result on small
integers (none should).

usage: python3 tools/rails_bound.py [PORT]      (on a host with 4 GPUs)
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (16 << 20, 64 << 20, 256 << 20, 1 << 30)
CHUNKS = (1, 2, 4, 8, 16)


def hierarchical(x, chunks: int, local, rail, streams) -> None:
    """``x`` = the sum over the 4 GPUs, in ``chunks`` pipelined chunks (see the module)."""
    cur = torch.cuda.current_stream()
    c = x.numel() // chunks
    shards = [torch.empty(c // 2, dtype=x.dtype, device=x.device) for _ in range(chunks)]
    if chunks == 1:
        dist.reduce_scatter_tensor(shards[0], x, group=local)
        dist.all_reduce(shards[0], group=rail)
        dist.all_gather_into_tensor(x, shards[0], group=local)
        return
    host, across = streams
    host.wait_stream(cur)
    across.wait_stream(cur)
    crossed = [None] * chunks

    def gather(k: int) -> None:
        host.wait_event(crossed[k])
        dist.all_gather_into_tensor(x[k * c:(k + 1) * c], shards[k], group=local)

    for k in range(chunks):
        with torch.cuda.stream(host):
            dist.reduce_scatter_tensor(shards[k], x[k * c:(k + 1) * c], group=local)
            reduced = host.record_event()
        with torch.cuda.stream(across):
            across.wait_event(reduced)
            dist.all_reduce(shards[k], group=rail)
            crossed[k] = across.record_event()
        if k >= 1:
            with torch.cuda.stream(host):
                gather(k - 1)
    with torch.cuda.stream(host):
        gather(chunks - 1)
    cur.wait_stream(host)
    cur.wait_stream(across)
    for s in shards:
        s.record_stream(host)
        s.record_stream(across)


def timed(fn, x, iters: int) -> tuple[float, float]:
    """(GPU us, CPU us) per call."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(int(0.1 * 1.98e9))
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    cpu = (time.perf_counter() - t0) / iters
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / iters, cpu * 1e6


def run(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    hosts = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rails = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    local, rail = hosts[rank // 2], rails[rank % 2]
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    variants = {"flat": dist.all_reduce}
    for chunks in CHUNKS:
        variants[f"hier{chunks}"] = lambda x, chunks=chunks: hierarchical(x, chunks, local, rail, streams)
    for size in SIZES:
        n = size // 2
        x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        iters = max(3, min(50, (4 << 30) // size))
        best: dict[str, tuple[float, float]] = {}
        for _ in range(2):
            for name, fn in variants.items():
                us, cpu = timed(fn, x, iters)
                if name not in best or us < best[name][0]:
                    best[name] = (us, cpu)
        y = torch.randint(-8, 8, (n,), device="cuda").to(torch.bfloat16)
        z = y.clone()
        dist.all_reduce(y)
        variants["hier4"](z)
        torch.cuda.synchronize()
        wrong = int((y != z).sum())
        if rank == 0:
            flat = best["flat"][0]
            cells = " ".join(f"{k}={us:.1f}us ({flat / us:.2f}x, cpu {cpu:.0f})" for k, (us, cpu) in best.items())
            print(f"{size >> 20:5d}M {cells} wrong={wrong}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if torch.cuda.device_count() < 4:
        sys.exit(f"needs 4 GPUs (this host has {torch.cuda.device_count()})")
    mp.spawn(run, args=(4, int(sys.argv[1]) if len(sys.argv) > 1 else 29711), nprocs=4)
