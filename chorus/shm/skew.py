"""Copies that avoid the slow offsets of some CPUs' string copy.

On the 2-core AMD EPYC machine (glibc 2.36, Linux 6.18) a copy whose destination sits a
few bytes past its source, modulo a 4 KiB page, runs 4-10x slower than at any other
offset: glibc's ``memmove`` and numpy's copy (256 KiB in 93-96 us against 8-12 us) as
well as the kernel's copy behind ``process_vm_readv`` (``bench/skew_probe.py``).  The
16-core Intel host showed no such step.  Where chorus chooses an address (the window's
data area: chorus.shm.window.SKEW; single copy's scratch) it keeps away from them; where
two user buffers meet, ``copy`` goes through a small private buffer placed half a page
from the source when their offsets are slow (two fast copies instead of one slow one).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

PAGE = 4096
#: A destination 1 to this many bytes - 1 past its source, within a page, is slow (8-24
#: bytes measured slow, 32 and up fast: a margin).
SLOW_BYTES = 64
#: ``copy`` bounces copies from this size up to ``MAX_BYTES``: glibc's ``memmove`` takes
#: the slow string copy only in between on that machine (at skew 16: 64 KiB 35 us against
#: 3, 256 KiB 126 against 10; 1 MiB 54 against 45, 4 MiB 170 against 177: no step), and
#: below, the bounce's Python costs more than it saves (32 KiB: 22 us against 16; 64 KiB
#: 28 against 41, 256 KiB 45 against 146).
MIN_BYTES = 64 << 10
MAX_BYTES = 512 << 10
#: A bounced copy moves in pieces of this size (they stay in the first-level caches).
PIECE_BYTES = 64 << 10
#: The per-thread bounce buffer's size (``beside``; chorus.shm.cma bounces kernel copies
#: in pieces of this size).
BOUNCE_BYTES = 256 << 10

_local = threading.local()


def slow(dst: int, src: int) -> bool:
    """Whether a copy from address ``src`` to address ``dst`` sits at a slow offset."""
    return 0 < (dst - src) % PAGE < SLOW_BYTES


_from_buffer, _addressof = ctypes.c_char.from_buffer, ctypes.addressof


def address(array) -> int:
    """Where a contiguous numpy array's data starts (0 for None).  Through ctypes' view of
    its buffer where numpy lends one (writable, C-contiguous, not empty): 0.45 us with the
    check, against 1.7 us for ``__array_interface__``, which builds a dict (2-core
    machine); every single-copy op asks this once or twice."""
    if array is None:
        return 0
    if array.flags.carray and array.size:  # C-contiguous, aligned and writable, not empty
        try:
            return _addressof(_from_buffer(array))
        except (TypeError, ValueError, BufferError):  # (a dtype without a buffer format)
            pass
    return array.__array_interface__["data"][0]


def beside(where: int, nbytes: int) -> np.ndarray:
    """``nbytes`` (at most ``BOUNCE_BYTES``) of this thread's bounce buffer, starting half a
    page from ``where``'s offset in its page: a copy between it and ``where``, or between
    it and an address at a slow offset from ``where``, is far from a slow offset."""
    bounce = _local.__dict__.get("bounce")
    if bounce is None:
        bounce = _local.bounce = np.empty(BOUNCE_BYTES + PAGE, np.uint8)
    start = (where + PAGE // 2 - address(bounce)) % PAGE
    return bounce[start: start + nbytes]


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for C-contiguous arrays of one dtype and size; through this
    thread's bounce buffer, piece by piece, where their offsets are slow (two fast copies:
    the buffer sits half a page from the source, and so from the destination)."""
    if not MIN_BYTES <= dst.nbytes < MAX_BYTES or not slow(address(dst), address(src)):
        dst[...] = src
        return
    to, frm = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
    middle, size = beside(address(frm), PIECE_BYTES), to.size  # (pieces start whole pages apart)
    for lo in range(0, size, PIECE_BYTES):
        hi = min(lo + PIECE_BYTES, size)
        part = middle[: hi - lo]
        part[...] = frm[lo:hi]
        to[lo:hi] = part
