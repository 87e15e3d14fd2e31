"""What a medium all_reduce over shared memory costs at the least, in plain Python and
numpy, by how the bytes move: W forked processes, float32, sum, no checks, no errors
handled, a barrier made of one counter per rank.  Rank 0 prints the best of three rounds
per variant and size, in microseconds per op, and checks the sum.

    two_shot    chorus's copy path for medium messages (chorus.shm.collectives):
                    rank r:  slot[r] <- data              (window, parity p)
                    barrier
                    rank r:  result[part r] <- sum over q of slot[q][part r]
                    barrier
                    rank r:  data <- result
                two copies of every byte (in, out) beside the reduction; two barriers
    direct      single copy, every rank reading every peer (chorus.shm.direct):
                    barrier
                    rank r:  stack[q] <- rank q's data[part r]   (process_vm_readv, all q)
                             data[part r] <- sum of the stack
                    barrier
                    rank r:  data[part q] <- rank q's data[part q]  (all q)
                    barrier
                W - 1 readers of each buffer at once
    ring        single copy, each rank reading its left neighbour only (the ring that
                MPI libraries run for medium and large messages over single copy):
                    barrier
                    W - 1 steps:  data[c] += left's data[c]     c = r - s - 1 (mod W)
                    W - 1 steps:  data[c] <- left's data[c]     c = r - t (mod W)
                a barrier after each step, one reader of each buffer at a time

usage: python3 tools/shm_floor.py W BYTES[,BYTES...] ITERS [VARIANT,...]
  e.g. python3 tools/shm_floor.py 8 262144,1048576 200
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time

import numpy as np

from chorus.shm import cma

VARIANTS = ("two_shot", "direct", "ring")
LINE = 16  # words per rank's counter line (128 bytes)


class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def process_vm_readv():
    fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(Iovec), ctypes.c_ulong, ctypes.POINTER(Iovec), ctypes.c_ulong,
                   ctypes.c_ulong]
    return fn


class Shared:
    """The window: counters, pids and buffer addresses, and two parities of slots."""

    def __init__(self, world: int, n: int):
        self.world, self.n = world, n
        self.buf = mmap.mmap(-1, 3 * 4096 + 2 * (world + 1) * n * 4)
        self.words = np.frombuffer(self.buf, np.int64, 3 * 4096 // 8)
        body = np.frombuffer(self.buf, np.float32, 2 * (world + 1) * n, offset=3 * 4096)
        self.slots = body[: 2 * world * n].reshape(2, world, n)
        self.results = body[2 * world * n:].reshape(2, n)

    def counter(self, q: int) -> int:
        return LINE * q

    def pid_word(self, q: int) -> int:
        return 4096 // 8 + LINE * q

    def addr_word(self, q: int) -> int:
        return 2 * 4096 // 8 + LINE * q


class Rank:
    def __init__(self, sh: Shared, me: int):
        self.sh, self.me, self.count = sh, me, 0
        self.world, self.n = sh.world, sh.n
        self.data = np.zeros(sh.n, np.float32)
        self.tmp = np.empty((sh.world, sh.n // sh.world), np.float32)
        self.read = process_vm_readv()
        self.local, self.remote = Iovec(), Iovec()
        cma.allow_peers()
        w = sh.words
        w[sh.pid_word(me)] = os.getpid()
        w[sh.addr_word(me)] = cma.address(self.data)
        self.barrier()
        self.pids = [int(w[sh.pid_word(q)]) for q in range(self.world)]
        self.addrs = [int(w[sh.addr_word(q)]) for q in range(self.world)]

    def barrier(self) -> None:
        w, sh = self.sh.words, self.sh
        self.count += 1
        count = self.count
        w[sh.counter(self.me)] = count
        for q in range(self.world):
            at = sh.counter(q)
            while w[at] < count:
                pass

    def pull(self, q: int, dst: np.ndarray, offset: int) -> None:
        """dst <- rank q's data[offset: offset + dst.size] (process_vm_readv)."""
        nbytes = dst.nbytes
        self.local.base, self.local.len = cma.address(dst), nbytes
        self.remote.base, self.remote.len = self.addrs[q] + offset * 4, nbytes
        if self.read(self.pids[q], self.local, 1, self.remote, 1, 0) != nbytes:
            raise OSError(ctypes.get_errno(), "process_vm_readv")

    def two_shot(self, p: int) -> None:
        sh, me, k = self.sh, self.me, self.n // self.world
        sh.slots[p, me] = self.data
        self.barrier()
        np.add.reduce(sh.slots[p, :, me * k:(me + 1) * k], axis=0, out=sh.results[p, me * k:(me + 1) * k])
        self.barrier()
        self.data[...] = sh.results[p]

    def direct(self, p: int) -> None:
        me, world, k, data = self.me, self.world, self.n // self.world, self.data
        stack = self.tmp
        self.barrier()  # every rank's data is its input (phase 0: publish)
        for q in range(world):
            if q != me:
                self.pull(q, stack[q], me * k)
        stack[me] = data[me * k:(me + 1) * k]
        self.barrier()  # every rank has read this rank's parts before it writes its own
        np.add.reduce(stack, axis=0, out=data[me * k:(me + 1) * k])
        self.barrier()
        for q in range(world):
            if q != me:
                self.pull(q, data[q * k:(q + 1) * k], q * k)
        self.barrier()  # nobody changes its data while a peer still reads it

    def ring(self, p: int) -> None:
        me, world, k, data = self.me, self.world, self.n // self.world, self.data
        left, tmp = (me - 1) % world, self.tmp[0]
        self.barrier()  # every rank's data is its input
        for s in range(world - 1):
            c = (me - s - 1) % world
            self.pull(left, tmp, c * k)
            part = data[c * k:(c + 1) * k]
            np.add(part, tmp, out=part)
            self.barrier()
        for t in range(world - 1):
            c = (me - t) % world
            self.pull(left, data[c * k:(c + 1) * k], c * k)
            self.barrier()


def run(sh: Shared, me: int, variant: str, iters: int) -> None:
    r = Rank(sh, me)
    op = getattr(r, variant)
    want = sh.world * (sh.world + 1) / 2
    best = float("inf")
    for _ in range(3):
        r.barrier()
        start = time.perf_counter()
        for i in range(iters):
            r.data[...] = me + 1
            op(i & 1)
        best = min(best, (time.perf_counter() - start) / iters)
        if not np.all(r.data == want):
            raise SystemExit(f"{variant}: rank {me} got a wrong sum")
    if me == 0:
        print(f"{variant:9s} W = {sh.world}, {sh.n * 4:>9d} B: {best * 1e6:8.1f} us per op "
              "(best of 3 rounds, each op includes resetting data)", flush=True)


def main(argv: list[str]) -> int:
    args = argv
    if len(args) < 3:
        raise SystemExit(__doc__)
    world, sizes, iters = int(args[0]), [int(s) for s in args[1].split(",")], int(args[2])
    variants = args[3].split(",") if len(args) > 3 else VARIANTS
    for nbytes in sizes:
        n = nbytes // 4 // world * world
        for variant in variants:
            sh = Shared(world, n)
            children = []
            for q in range(1, world):
                pid = os.fork()
                if pid == 0:
                    try:
                        run(sh, q, variant, iters)
                    finally:
                        os._exit(0)
                children.append(pid)
            run(sh, 0, variant, iters)
            for pid in children:
                os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
