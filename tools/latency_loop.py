"""Small all_reduce latency, bare: W processes (chorus.spawn) call ``all_reduce`` on a
tiny float32 array in a loop, three rounds; rank 0 prints the best round's time per op.
``--floor`` instead times the least plain numpy can do over shared memory for the same
exchange (copy in, raise a counter, spin on the others', reduce): what Python itself costs.
``--native`` times the same exchange as one call per op into C (compiled here with ``cc``,
called through ctypes): what a compiled step would leave of that cost.

``--pin`` binds rank r to one CPU, spreading the ranks over physical cores first
(``pin_order``), for both.

usage: python3 tools/latency_loop.py [--floor | --native] [--pin] [W] [ELEMENTS] [ITERS]
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
    from chorus.host.cpus import cores

    groups = cores(os.sched_getaffinity(0))
    return [core[0] for core in groups] + sorted(cpu for core in groups for cpu in core[1:])


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


#: the exchange of --floor as one C function: copy in, raise my counter, spin on the
#: others', reduce in rank order into ``data``
STEP_C = r"""
#include <stdint.h>
#include <string.h>
void step(float *slots, int64_t *counters, int world, int me, int n, float *data, int64_t count) {
    float *mine = slots + ((size_t)((count - 1) & 1) * world) * n;
    memcpy(mine + (size_t)me * n, data, (size_t)n * sizeof(float));
    __atomic_store_n(&counters[16 * me], count, __ATOMIC_RELEASE);
    for (int q = 0; q < world; q++)
        while (__atomic_load_n(&counters[16 * q], __ATOMIC_ACQUIRE) < count)
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#else
            ;
#endif
    for (int i = 0; i < n; i++) {
        float s = mine[i];
        for (int q = 1; q < world; q++)
            s += mine[(size_t)q * n + i];
        data[i] = s;
    }
}
"""


def _native_step():
    """STEP_C compiled with ``cc`` and loaded: its ``step`` with typed arguments."""
    import ctypes
    import subprocess
    import tempfile

    where = tempfile.mkdtemp(prefix="chorus-step-")
    src, lib = os.path.join(where, "step.c"), os.path.join(where, "step.so")
    with open(src, "w") as f:
        f.write(STEP_C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
    step = ctypes.CDLL(lib).step
    step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                     ctypes.c_int64]
    step.restype = None
    return step


def _floor(world: int, n: int, iters: int, native: bool = False) -> None:
    buf = mmap.mmap(-1, 4096 + 2 * world * max(n * 4, 64) + 4096)
    counters = np.frombuffer(buf, np.int64, world * 16)  # rank r's counter at word 16 r
    slots = np.frombuffer(buf, np.float32, 2 * world * n, offset=4096).reshape(2, world, n)
    step = _native_step() if native else None

    def run(me: int) -> None:
        _pin(me)
        data, count, best = np.full(n, me + 1, np.float32), 0, float("inf")
        addresses = (slots.ctypes.data, counters.ctypes.data, world, me, n, data.ctypes.data)
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(iters):
                if step is not None:
                    count += 1
                    step(*addresses, count)
                    data[...] = me + 1
                    continue
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
            what = "one C call per op" if native else "plain numpy"
            print(f"{what} over shared memory, W = {world}, {n} float32: {best * 1e6:.2f} us per op")

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
    floor, native = "--floor" in argv, "--native" in argv
    if "--pin" in argv:
        os.environ["LATENCY_PIN"] = "1"  # inherited by the ranks
    args = [int(a) for a in argv if a not in ("--floor", "--native", "--pin")]
    world, n, iters = (args + [2, 1, 20000][len(args):])[:3]
    if floor or native:
        _floor(world, n, iters, native)
        return 0
    from chorus.launch.spawn import spawn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(_chorus, args=(world, port, n, iters), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
