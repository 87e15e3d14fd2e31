"""How fast one process reads another's memory with ``process_vm_readv`` (chorus's single
copy) against a plain numpy copy of the same bytes, for blocks that stay in the caches
(the same block read again and again) and for blocks that do not (a sweep over a
buffer larger than the caches): where the kernel's per-page work, not the copy, sets
single copy's rate.

usage: python3 tools/cma_rate.py [BLOCK_KIB] [BIG_MIB] [THREADS]
  e.g. python3 tools/cma_rate.py 512 256 1
A child process holds the source; the parent reads it, THREADS threads at once.
``CMA_THP=1``: the source is 2 MiB-aligned and advised into transparent huge pages
(printed: how much of the process's memory the kernel backed with them).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _readv(pid: int, local: int, remote: int, n: int) -> None:
    lo, re = _Iovec(local, n), _Iovec(remote, n)
    got = _libc.process_vm_readv(pid, ctypes.byref(lo), 1, ctypes.byref(re), 1, 0)
    if got != n:
        raise OSError(ctypes.get_errno(), "process_vm_readv")


def _like(src_address: int, nbytes: int) -> np.ndarray:
    """A float32 array of ``nbytes`` at the same offset within its page as ``src_address``
    (copies between buffers at other relative offsets can be slower: chorus.shm.skew)."""
    raw = np.empty(nbytes + 8192, np.uint8)
    at = (src_address - raw.ctypes.data) % 4096
    return raw[at: at + nbytes].view(np.float32)


def _rate(fn, nbytes: int, seconds: float = 0.5) -> float:
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        done += nbytes
    return done / (time.perf_counter() - start) / 1e9


def _source(nbytes: int) -> np.ndarray:
    """The float32 array of ones that the child holds (``CMA_THP``: in huge pages)."""
    if not os.environ.get("CMA_THP"):
        return np.ones(nbytes // 4, np.float32)
    huge = 2 << 20
    m = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(m, np.uint8)
    at = -raw.ctypes.data % huge
    m.madvise(mmap.MADV_HUGEPAGE, at, nbytes)
    src = raw[at: at + nbytes].view(np.float32)
    src[:] = 1
    with open("/proc/self/smaps_rollup") as f:
        print("source in huge pages:", [line.split()[1] + " kB" for line in f if line.startswith("AnonHugePages")])
    return src


def main(argv: list[str]) -> int:
    block = int(argv[0]) << 10 if argv else 512 << 10
    big = int(argv[1]) << 20 if len(argv) > 1 else 256 << 20
    threads = int(argv[2]) if len(argv) > 2 else 1
    src = _source(big)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.read(r, 1)  # hold src until the parent is done
        os._exit(0)
    os.close(r)
    base = src.ctypes.data
    nblocks = big // block

    def run(kind: str, hot: bool) -> float:
        dsts = [_like(base, block) for _ in range(threads)]
        own = [np.ones(big // 4, np.float32) for _ in range(threads)] if kind == "numpy" and not hot else None
        rates = [0.0] * threads

        def worker(t: int) -> None:
            dst, k = dsts[t], [t * 997]

            def one() -> None:
                i = 0 if hot else k[0] % nblocks
                k[0] += 1
                if kind == "cma":
                    _readv(pid, dst.ctypes.data, base + i * block, block)
                else:
                    s = (src if own is None else own[t])[i * (block // 4): (i + 1) * (block // 4)]
                    np.copyto(dst, s)
            rates[t] = _rate(one, block)

        ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return sum(rates)

    for hot in (True, False):
        for kind in ("cma", "numpy"):
            print(f"{kind:5s} {'hot ' if hot else 'cold'} block {block >> 10} KiB x {threads} thread(s): "
                  f"{run(kind, hot):6.1f} GB/s copied")
    os.close(w)
    os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
