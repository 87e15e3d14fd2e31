"""Small all_reduce latency, bare: W processes (chorus.spawn) call ``all_reduce`` on a
tiny float32 array in a loop, three rounds; rank 0 prints the best round's time per op.
``--floor`` instead times the least plain numpy can do over shared memory for the same
exchange (copy in, raise a counter, spin on the others', reduce): what Python itself costs.

``--pin`` binds rank r to one CPU, spreading the ranks over physical cores first
(``pin_order``), for both.

usage: python3 tools/latency_loop.py [--floor] [--pin] [W] [ELEMENTS] [ITERS]
  e.g. python3 tools/latency_loop.py 2 1 20000; python3 tools/latency_loop.py --floor 2 1 20000
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
import time

import numpy as np


def pin_order() -> list[int]:
    """This process's CPUs, one per physical core first (then their hyperthread siblings)."""
    cpus = sorted(os.sched_getaffinity(0))
    first, rest, seen = [], [], set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                core = f.read().strip()
        except OSError:
            core = str(cpu)
        (rest if core in seen else first).append(cpu)
        seen.add(core)
    return first + rest


def _pin(rank: int) -> None:
    if os.environ.get("LATENCY_PIN"):
        order = pin_order()
        os.sched_setaffinity(0, {order[rank % len(order)]})


def _chorus(rank: int, world: int, port: int, n: int, iters: int) -> None:
    import chorus as dist

    _pin(rank)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(rank=rank, world_size=world)
    data = np.full(n, rank + 1, np.float32)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(data)
            data[...] = rank + 1
        best = min(best, (time.perf_counter() - start) / iters)
    if rank == 0:
        print(f"chorus all_reduce, W = {world}, {n} float32: {best * 1e6:.2f} us per op (best of 3 rounds)")
    dist.destroy_process_group()


def _floor(world: int, n: int, iters: int) -> None:
    buf = mmap.mmap(-1, 4096 + 2 * world * max(n * 4, 64) + 4096)
    counters = np.frombuffer(buf, np.int64, world * 16)  # rank r's counter at word 16 r
    slots = np.frombuffer(buf, np.float32, 2 * world * n, offset=4096).reshape(2, world, n)

    def run(me: int) -> None:
        _pin(me)
        data, count, best = np.full(n, me + 1, np.float32), 0, float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(iters):
                p = count & 1
                slots[p, me] = data
                count += 1
                counters[16 * me] = count
                for q in range(world):
                    while counters[16 * q] < count:
                        pass
                np.add.reduce(slots[p], axis=0, out=data)
                data[...] = me + 1
            best = min(best, (time.perf_counter() - start) / iters)
        if me == 0:
            print(f"plain numpy over shared memory, W = {world}, {n} float32: {best * 1e6:.2f} us per op")

    children = []
    for r in range(1, world):
        pid = os.fork()
        if pid == 0:
            run(r)
            os._exit(0)
        children.append(pid)
    run(0)
    for pid in children:
        os.waitpid(pid, 0)


def main(argv: list[str]) -> int:
    floor = "--floor" in argv
    if "--pin" in argv:
        os.environ["LATENCY_PIN"] = "1"  # inherited by the ranks
    args = [int(a) for a in argv if a not in ("--floor", "--pin")]
    world, n, iters = (args + [2, 1, 20000][len(args):])[:3]
    if floor:
        _floor(world, n, iters)
        return 0
    from chorus.launch.spawn import spawn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_chorus, args=(world, port, n, iters), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
