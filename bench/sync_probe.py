"""How much of a small all_reduce's time the layout of the first sync's words costs: W
forked processes run a bare one-shot all_reduce of ELEMENTS float32 (copy in, sync,
reduce the W rows) in pure Python over an anonymous shared mapping, with the sync's words
laid out one of two ways, alternating rounds:

    lines   each rank's counter and token in a cache line of its own (chorus.shm.sync's
            layout above 8 ranks): the last rank to arrive reads W - 1 counters and W - 1
            tokens from W - 1 lines
    packed  per parity, every rank's counter in one 64-byte line and its token in the
            next (chorus.shm.sync's arrival blocks, W <= 8): one read of 16 x W bytes
            compared with the bytes they must hold

Each rank writes its token, then its counter, every op, in both layouts.  Prints, per
round, the mean time per op (us) of the slowest rank.  No chorus code runs: this
isolates the sync's reads from everything else on the latency path.

usage: python3 bench/sync_probe.py W [ELEMENTS] [ITERS] [ROUNDS]
"""

from __future__ import annotations

import mmap
import os
import sys
import time

import numpy as np

LINE_WORDS = 24  # 192 bytes per rank, as chorus.shm.sync.WORDS
TOKEN = 5


def run(variant: str, rank: int, world: int, mm: mmap.mmap, n: int, iters: int, base: int,
        results) -> None:
    words = memoryview(mm).cast("q")
    packed_at = world * LINE_WORDS  # word index of the blocks (64-byte aligned: 192 * W)
    blocks = [memoryview(mm)[(packed_at + 16 * p) * 8: (packed_at + 16 * p + 2 * world) * 8] for p in (0, 1)]
    slots_at = (packed_at + 32) * 8
    rows = np.frombuffer(mm, np.float32, 2 * world * n, slots_at).reshape(2, world, n)
    mine = [rows[0, rank], rows[1, rank]]
    data = np.full(n, rank + 1, np.float32)
    reduce = np.add.reduce
    others = tuple(q * LINE_WORDS for q in range(world) if q != rank)
    me = rank * LINE_WORDS
    count = base
    start = time.perf_counter()
    if variant == "lines":
        for _ in range(iters):
            p = count & 1
            words[me + TOKEN + p] = count ^ 0x5A5A  # the op's token (here: any word of the op)
            mine[p][...] = data
            count += 1
            words[me] = count
            token = (count - 1) ^ 0x5A5A
            for i in others:
                while words[i] < count:
                    pass
                if words[i + TOKEN + p] != token:
                    raise RuntimeError("token")
            reduce(rows[p], axis=0, out=data)
            data.fill(rank + 1)
    else:
        for _ in range(iters):
            p = count & 1
            token = count ^ 0x5A5A
            words[packed_at + 16 * p + world + rank] = token
            mine[p][...] = data
            count += 1
            words[packed_at + 16 * p + rank] = count
            expect = count.to_bytes(8, sys.byteorder) * world + token.to_bytes(8, sys.byteorder) * world
            block = blocks[p]
            while block.tobytes() != expect:
                pass
            reduce(rows[p], axis=0, out=data)
            data.fill(rank + 1)
    results[rank] = (time.perf_counter() - start) / iters


def main(argv: list[str]) -> int:
    world = int(argv[0])
    n = int(argv[1]) if len(argv) > 1 else 1
    iters = int(argv[2]) if len(argv) > 2 else 20000
    rounds = int(argv[3]) if len(argv) > 3 else 3
    assert world <= 8
    size = (world * LINE_WORDS + 32) * 8 + 2 * world * n * 4 + 4096
    mm = mmap.mmap(-1, size)
    out = mmap.mmap(-1, 8 * world * 2)
    times = memoryview(out).cast("d")
    count = 0
    for r in range(rounds):
        for variant in ("lines", "packed"):
            # warm-up then measured: counters continue from the last value
            pids = []
            for rank in range(world):
                pid = os.fork()
                if pid == 0:
                    try:
                        run(variant, rank, world, mm, n, 2000, count, times)
                        run(variant, rank, world, mm, n, iters, count + 2000, times)
                    finally:
                        os._exit(0)
                pids.append(pid)
            for pid in pids:
                _, status = os.waitpid(pid, 0)
                assert status == 0
            count += 2000 + iters
            # every counter, in both layouts, continues from count (the blocks' parities too)
            w = memoryview(mm).cast("q")
            for q in range(world):
                w[q * LINE_WORDS] = count
                for p in (0, 1):
                    w[world * LINE_WORDS + 16 * p + q] = count
            per = [times[q] * 1e6 for q in range(world)]
            print(f"round {r} {variant:7s} W={world} n={n}: slowest {max(per):.2f} us, "
                  f"ranks {min(per):.2f}-{max(per):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
