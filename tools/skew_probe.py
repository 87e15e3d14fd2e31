"""How fast this machine copies memory when the destination sits a few bytes past the
source within a page: the kernel's copy (``process_vm_readv`` / ``process_vm_writev``,
behind chorus.shm.cma) and the user-space one (``memmove``, numpy's copy).

usage: python3 tools/skew_probe.py [KIB]          (default 256 KiB per copy)

For each skew (destination address minus source address, modulo 4096) prints the median
microseconds of each copy, from buffers at page offsets 0 and 1000.  On some machines
(an AMD EPYC VM with glibc 2.36, for one) a few small skews make every one of these copies
several times slower; chorus.shm.skew and chorus.shm.cma route copies around them.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import time

import numpy as np


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _median_us(fn, n: int = 25) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e6


def _times(libc, pid: int, src: np.ndarray, dst: np.ndarray) -> tuple[float, ...]:
    """Median us of readv, writev, memmove and np.copyto from ``src`` into ``dst``."""
    s_addr, d_addr, nbytes = src.ctypes.data, dst.ctypes.data, src.nbytes
    src_iov, dst_iov = _Iovec(s_addr, nbytes), _Iovec(d_addr, nbytes)
    return (_median_us(lambda: libc.process_vm_readv(pid, ctypes.byref(dst_iov), 1, ctypes.byref(src_iov), 1, 0)),
            _median_us(lambda: libc.process_vm_writev(pid, ctypes.byref(src_iov), 1, ctypes.byref(dst_iov), 1, 0)),
            _median_us(lambda: ctypes.memmove(d_addr, s_addr, nbytes)),
            _median_us(lambda: np.copyto(dst, src)))


def main(argv: list[str]) -> int:
    nbytes = int(argv[0]) << 10 if argv else 256 << 10
    libc = ctypes.CDLL(None, use_errno=True)
    src_mem = np.frombuffer(mmap.mmap(-1, nbytes + 3 * 4096), np.uint8)
    dst_mem = np.frombuffer(mmap.mmap(-1, nbytes + 3 * 4096), np.uint8)
    src_mem[:] = 1
    dst_mem[:] = 2
    pid = os.getpid()
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"# {model}; {platform.libc_ver()[0]} {platform.libc_ver()[1]}; Linux {platform.release()}; "
          f"{nbytes >> 10} KiB per copy; median us")
    print(f"{'offset':>6} {'skew':>5} {'readv':>7} {'writev':>7} {'memmove':>8} {'np.copyto':>9}")
    for offset in (0, 1000):
        for skew in (0, 8, 16, 32, 48, 56, 64, 128, 2048, 4096 - 16):
            src = src_mem[offset: offset + nbytes]
            dst = dst_mem[offset + skew: offset + skew + nbytes]
            readv, writev, move, copy = _times(libc, pid, src, dst)
            print(f"{offset:6d} {skew:5d} {readv:7.0f} {writev:7.0f} {move:8.0f} {copy:9.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
