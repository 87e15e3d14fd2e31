"""Which CPUs of this host share a physical core, as seen from inside a VM that hides it:
a pure-Python loop on CPU 0 is timed alone and with a busy process on CPU j, for every
other j; a sibling hyperthread slows it far more than another core does.

usage: python3 tools/sibling_probe.py [CPU]   (prints j and the slowdown, worst first;
       CPU: the CPU to time, default the first allowed)
"""

from __future__ import annotations

import os
import sys
import time


def _work(n: int = 1_000_000) -> float:
    start = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    cpus = sorted(os.sched_getaffinity(0))
    me = int(argv[0]) if argv else cpus[0]
    os.sched_setaffinity(0, {me})
    alone = min(_work() for _ in range(3))
    rows = []
    for j in cpus:
        if j == me:
            continue
        pid = os.fork()
        if pid == 0:
            os.sched_setaffinity(0, {j})
            end = time.monotonic() + 5
            while time.monotonic() < end:
                pass
            os._exit(0)
        time.sleep(0.01)
        busy = min(_work() for _ in range(3))
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        rows.append((busy / alone, j))
    print(f"CPU {me} alone: {alone * 1e3:.1f} ms per loop")
    for ratio, j in sorted(rows, reverse=True):
        print(f"  busy CPU {j:3d}: x{ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
