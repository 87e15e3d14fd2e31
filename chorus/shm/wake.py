"""Waking the ranks that sleep in a sync, instead of letting them sleep out their nap.

A rank that has waited long in a sync (chorus.shm.sync: it spun, yielded, and now naps
50 us to 1 ms at a time) used to find out that the last rank arrived only when its nap
ended: up to a millisecond late, at every sync where ranks arrive far apart (a DDP
bucket whose gradients are ready at different times on each rank; a benchmark whose
ranks check their results between ops).  The whole op then waits for it.

Now a napping rank sleeps on a futex in the window's header page, and the rank whose
arrival completes the sync wakes it::

    header page, offset 64     WAKE    a 32-bit counter (futex word); any rank bumps it
    header page, offset 128    ASLEEP  one byte per rank: 1 while that rank naps

    waiter r (instead of sleeping ``nap``):   v <- WAKE;  ASLEEP[r] <- 1
                                              if every rank arrived: ASLEEP[r] <- 0, done
                                              futex_wait(WAKE, v, timeout nap);  ASLEEP[r] <- 0
    a rank that finds every rank arrived:     if any ASLEEP: futex_wake_op(WAKE += 1, wake all)

The kernel adds to the word and wakes in one call (``FUTEX_WAKE_OP``), so the word only
ever moves forward: a waiter that read it before the bump finds it changed and does not
sleep.  The nap stays the timeout, so nothing waits longer than before: a waiter whose
mark and an arrival cross unseen (x86 may let a load pass an earlier store, and Python
has no fence) sleeps its nap out, as every waiter did before.  Spurious wake-ups are
harmless: the waiter looks at the counters again.

Where the futex system call is not available (not Linux, a 32-bit process, an
architecture whose call number is not known here), ``Waker.make`` returns None and
waiters nap as before.
"""

from __future__ import annotations

import ctypes
import platform
import sys

import numpy as np

WAKE_OFFSET = 64  # in the window's header page (chorus.shm.window)
ASLEEP_OFFSET = 128
HEADER_PAGE = 4096
MAX_RANKS = HEADER_PAGE - ASLEEP_OFFSET  # one byte per rank in the header page

_FUTEX_WAIT, _FUTEX_WAKE_OP = 0, 5  # shared (not FUTEX_PRIVATE_FLAG): the ranks are processes
#: FUTEX_WAKE_OP's operation: add 1 to the word (FUTEX_OP_ADD, oparg 1); its comparison
#: (FUTEX_OP_CMP_EQ 0) only decides a second wake-up of no waiters (val2 = 0).
_ADD_ONE = (1 << 28) | (0 << 24) | (1 << 12) | 0
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


_syscall = None


def _futex_call():
    """libc's ``syscall`` set up for futex, and the call's number; None where unknown."""
    global _syscall
    number = _SYS_FUTEX.get(platform.machine().lower())  # the kernel's architecture ...
    if number is None or not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None  # ... which a 32-bit process on a 64-bit kernel does not share
    if _syscall is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).syscall
        except (OSError, AttributeError):
            return None
        fn.restype = ctypes.c_long
        fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                       ctypes.POINTER(_Timespec), ctypes.c_void_p, ctypes.c_int]
        _syscall = fn
    return _syscall, number


class Waker:
    """Rank ``rank``'s side of one window's wake word and sleep marks (see above)."""

    def __init__(self, buf, world: int, rank: int, call):
        self._fn, self._number = call
        self.rank = rank
        # The word's address, for the system call; the view that gave it is dropped at once,
        # so that it does not keep the mapping exported (the address stays valid while the
        # window is mapped, and the window is unmapped only after the group's last op).
        self._address = np.frombuffer(buf, np.uint32, count=1, offset=WAKE_OFFSET).__array_interface__["data"][0]
        self.word = memoryview(buf)[WAKE_OFFSET: WAKE_OFFSET + 4].cast("I")
        self.marks = memoryview(buf)[ASLEEP_OFFSET: ASLEEP_OFFSET + world]
        words = -(-world // 8)
        # The marks read 8 at a time (bytes past the last rank stay 0; the page is zeroed).
        self.asleep = memoryview(buf)[ASLEEP_OFFSET: ASLEEP_OFFSET + 8 * words].cast("Q")
        self._timeout = _Timespec()
        self.wakes = 0  # futex_wake calls made (tests check the path was taken)

    @classmethod
    def make(cls, buf, world: int, rank: int) -> Waker | None:
        """A Waker for the window in ``buf``, or None where waiters must nap instead."""
        call = _futex_call()
        if call is None or world > MAX_RANKS:
            return None
        return cls(buf, world, rank, call)

    def sleep(self, seconds: float, arrived) -> None:
        """Sleep until woken or for ``seconds``, unless ``arrived()`` (every rank reached the
        sync) is already true once this rank is marked asleep."""
        value = self.word[0]
        self.marks[self.rank] = 1
        try:
            if arrived():
                return
            t = self._timeout
            t.sec, t.nsec = int(seconds), int((seconds % 1.0) * 1e9)
            self._fn(self._number, self._address, _FUTEX_WAIT, value, t, None, 0)
        finally:
            self.marks[self.rank] = 0

    def wake(self) -> None:
        """Wake every rank that sleeps on the window, if any is marked asleep."""
        for word in self.asleep:
            if word:
                self._fn(self._number, self._address, _FUTEX_WAKE_OP, _WAKE_ALL, None, self._address, _ADD_ONE)
                self.wakes += 1
                return

    def release(self) -> None:
        for view in (self.word, self.marks, self.asleep):
            view.release()
