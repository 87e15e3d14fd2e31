"""Copies between buffers: Cross Memory Attach between processes, and copies that avoid
the slow offsets of some CPUs' string copy.

Cross Memory Attach (CMA) copies straight between this rank's memory and a peer's.

``process_vm_readv(2)`` copies bytes of another process's address space into this one
(``process_vm_writev(2)`` the other way) in one kernel call, without shared mappings:
what MPICH and Open MPI use for large messages inside a host.  A shared-memory
collective then copies every byte once (peer's buffer -> my buffer) instead of twice
(peer's buffer -> window -> my buffer); chorus.shm.direct uses it for large
messages (its ``cma_bytes``).

Who may read whom: the kernel allows it where ``ptrace`` would be allowed — same user,
both dumpable and, under Yama (``/proc/sys/kernel/yama/ptrace_scope``):

    0   any process of the same user                  (nothing to do)
    1   only descendants, unless the target process   (every rank calls
        declares prctl(PR_SET_PTRACER, ANY)             :func:`allow_peers`)
    2   only processes with CAP_SYS_PTRACE            (probe fails: copy path)
    3   nobody                                        (probe fails: copy path)

With scope 1, ``PR_SET_PTRACER_ANY`` lets *any* process of the user ptrace the rank, not
only its peers; ``CHORUS_SHM_CMA=0`` keeps Yama's default (and the copy path).
Containers with separate pid namespaces, seccomp filters (older Docker profiles) and
kernels without CMA (``ENOSYS``) all fail the probe that chorus.shm.handshake runs when a
group's window is created: every member reads 8 random bytes from every other member
(and writes them back), and the group uses CMA only if every member succeeded.

Ranks that are threads of one process (``chorus.testing.run_threads``) read their own
process: ``process_vm_readv`` on one's own pid works like any other.

Errors during an op: ``ESRCH`` (the peer's process is gone) becomes :class:`PeerGone`, a
PeerLostError naming the rank; ``EFAULT`` (its buffer is no longer mapped: it left the
op) AbortedError; anything else (EPERM after a successful probe, ENOMEM, ...)
:class:`CmaError`, whose message says to set ``CHORUS_SHM_CMA=0``.

``CHORUS_SHM_CMA=0`` turns single copy off (on any member: for the whole group).

*Slow offsets.*  On some x86 CPUs (AMD EPYC, glibc 2.36, Linux 6.18) a copy whose
destination sits a few bytes past its source, modulo a 4 KiB page, runs 4-10x slower
than at any other offset: glibc's ``memmove`` and numpy's copy (256 KiB in 93-96 us
against 8-12 us) as well as the kernel's copy behind ``process_vm_readv``
(``tools/skew_probe.py``; Intel hosts showed no such step).  Two numpy buffers from the
heap sit at random 16-byte offsets, so single copy between them was slow in one run and
not the next.  Where chorus chooses an address (the window's data area:
chorus.shm.window.SKEW; single copy's scratch) it keeps away from them; where two user
buffers meet, ``copy`` and ``Peers`` go through a small private buffer placed half a page
from the source when their offsets are slow (two fast copies instead of one slow one).

With a recorder attached (chorus.recorder), every read or write of a peer's memory
reports a ``copy`` event naming the peer.
"""
from __future__ import annotations

import ctypes
import errno
import os
import secrets
import threading
import time
from collections.abc import Sequence

import numpy as np

from chorus import recorder
from chorus.errors import AbortedError, ChorusError, PeerLostError

_YAMA = "/proc/sys/kernel/yama/ptrace_scope"
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

PAGE = 4096
#: A destination 1 to this many bytes - 1 past its source, within a page, is slow (8-24
#: bytes measured slow, 32 and up fast: a margin).
SLOW_BYTES = 64
#: ``copy`` bounces copies from this size up to ``MAX_BYTES``: glibc's ``memmove`` takes
#: the slow string copy only in between (at skew 16: 64 KiB 35 us against 3, 256 KiB 126
#: against 10; 1 MiB 54 against 45, 4 MiB 170 against 177: no step), and below, the
#: bounce's Python costs more than it saves (32 KiB: 22 us against 16; 64 KiB 28 against
#: 41, 256 KiB 45 against 146).  (tools/skew_probe.py)
MIN_BYTES = 64 << 10
MAX_BYTES = 512 << 10
#: A bounced user-space copy moves in pieces of this size (they stay in the first-level caches).
PIECE_BYTES = 64 << 10
#: The per-thread bounce buffer's size (``beside``); kernel copies bounce in pieces of this size.
BOUNCE_BYTES = 256 << 10


class CmaError(ChorusError):
    """A cross-memory read or write failed for a reason other than a lost peer."""


class PeerGone(PeerLostError):
    """The peer's process no longer exists (ESRCH): found before the transport says so."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = None


def _calls():
    """(process_vm_readv, process_vm_writev) from libc, or None where libc lacks them."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    try:
        fns = _libc.process_vm_readv, _libc.process_vm_writev
    except AttributeError:
        return None
    for fn in fns:
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                       ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    return fns


def allow_peers() -> None:
    """Under Yama ptrace_scope 1, let processes that are not our ancestors (the peers)
    read and write this process's memory (see the module docstring)."""
    try:
        with open(_YAMA) as f:
            scope = f.read().strip()
    except OSError:
        return
    if scope == "1":
        _prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY)


def _prctl(option: int, arg: int) -> int:
    return ctypes.CDLL(None, use_errno=True).prctl(option, ctypes.c_ulong(arg), 0, 0, 0)


def slow(dst: int, src: int) -> bool:
    """Whether a copy from address ``src`` to address ``dst`` sits at a slow offset."""
    return 0 < (dst - src) % PAGE < SLOW_BYTES


_from_buffer, _addressof = ctypes.c_char.from_buffer, ctypes.addressof


def address(array) -> int:
    """Where a contiguous numpy array's data starts (0 for None).  Through ctypes' view of
    its buffer where numpy lends one (writable, C-contiguous, not empty): 0.45 us with the
    check, against 1.7 us for ``__array_interface__``, which builds a dict; every
    single-copy op asks this once or twice."""
    if array is None:
        return 0
    if array.flags.carray and array.size:  # C-contiguous, aligned and writable, not empty
        try:
            return _addressof(_from_buffer(array))
        except (TypeError, ValueError, BufferError):  # (a dtype without a buffer format)
            pass
    return array.__array_interface__["data"][0]


_local = threading.local()


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


class Probe:
    """8 random bytes that the other members read (and write back) at window creation."""

    def __init__(self):
        self.value = int.from_bytes(secrets.token_bytes(8), "little") or 1
        self.cell = ctypes.c_uint64(self.value)
        self.address = ctypes.addressof(self.cell)
        self.pid = os.getpid()


def probe(me: int, pids: Sequence[int], addresses: Sequence[int], values: Sequence[int]) -> str | None:
    """Read, then write back, every other member's probe; None if all worked, else why not."""
    fns = _calls()
    if fns is None:
        return "libc has no process_vm_readv"
    got = ctypes.c_uint64(0)
    for q, (pid, addr, value) in enumerate(zip(pids, addresses, values, strict=True)):
        if q == me:
            continue
        if value == 0:
            return f"group rank {q} runs with CHORUS_SHM_CMA=0"
        for fn, what in ((fns[0], "read"), (fns[1], "write")):
            n, err = _call(fn, pid, ctypes.addressof(got), addr, 8)
            if n != 8:
                return f"cannot {what} group rank {q}'s memory (pid {pid}): {_strerror(err)}"
            if got.value != value:
                return (f"group rank {q}'s pid {pid} is another process here (separate pid "
                        "namespaces?)")
    return None


def _strerror(err: int) -> str:
    hint = {errno.EPERM: " (Yama ptrace_scope >= 2, a seccomp filter or another user?)",
            errno.ENOSYS: " (the kernel has no cross-memory attach)"}.get(err, "")
    return f"{errno.errorcode.get(err, err)} {os.strerror(err)}{hint}"


def _call(fn, pid: int, local: int, remote: int, nbytes: int) -> tuple[int, int]:
    """One call for ``nbytes`` between ``local`` and ``remote``: (bytes moved, errno)."""
    mine, theirs = _Iovec(local, nbytes), _Iovec(remote, nbytes)
    moved = fn(pid, mine, 1, theirs, 1, 0)
    return moved, (ctypes.get_errno() if moved < 0 else 0)


class Peers:
    """Direct reads and writes of the other members' memory, for one rank of one window.

    ``pids[q]`` is group rank q's process id (published at window creation).  Counts the
    calls and bytes moved (``calls``, ``nbytes``): tests check the path was taken.
    """

    def __init__(self, pids: Sequence[int]):
        self.pids = tuple(pids)
        self.readv, self.writev = _calls()
        self.calls = 0
        self.nbytes = 0
        self._counting = threading.Lock()  # helper threads (chorus.shm.phases.Crew) read at once
        self._iov = threading.local()  # _call_one's iovecs, one pair per thread
        self._scratch = None

    def read_one(self, ctx, q: int, local: int, remote: int, nbytes: int) -> None:
        """Copy ``nbytes`` of rank ``q``'s memory at ``remote`` to ``local`` here."""
        self._one(self.readv, "read", ctx, q, local, remote, nbytes)

    def write_one(self, ctx, q: int, local: int, remote: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``local`` here into rank ``q``'s memory at ``remote``."""
        self._one(self.writev, "write", ctx, q, local, remote, nbytes)

    def _one(self, fn, what: str, ctx, q: int, local: int, remote: int, nbytes: int) -> None:
        """One piece through this thread's own iovecs (built once, not per call); where the
        kernel's copy would be slow (``slow``), through this thread's bounce buffer."""
        if nbytes <= 0:
            return  # (an empty part of an uneven op: no call, nothing counted)
        start = time.perf_counter() if recorder.current is not None else 0.0
        if slow(local, remote) if what == "read" else slow(remote, local):
            self._bounced(fn, what, ctx, q, local, remote, nbytes)
        else:
            self._call_one(fn, what, ctx, q, local, remote, nbytes)
        if start:
            recorder.transfer("copy", ctx, "shm", start, nbytes, ctx.members[q], direction=what)

    def _call_one(self, fn, what: str, ctx, q: int, local: int, remote: int, nbytes: int) -> None:
        iov = self._iov.__dict__.get("pair")
        if iov is None:
            iov = self._iov.pair = (_Iovec(), _Iovec())
        mine, theirs = iov
        mine.base, mine.len, theirs.base, theirs.len = local, nbytes, remote, nbytes
        moved = fn(self.pids[q], mine, 1, theirs, 1, 0)
        if moved > 0:
            with self._counting:
                self.calls += 1
                self.nbytes += moved
        if moved != nbytes:
            self._rest(fn, what, ctx, q, local, remote, nbytes, max(moved, 0))

    def _rest(self, fn, what: str, ctx, q: int, local: int, remote: int, nbytes: int, done: int) -> None:
        """The rest of a piece of which the kernel moved only ``done`` bytes; raise if it
        moves nothing."""
        while done < nbytes:
            moved, err = _call(fn, self.pids[q], local + done, remote + done, nbytes - done)
            with self._counting:
                self.calls += 1
                self.nbytes += max(moved, 0)
            if moved <= 0:
                raise self._error(what, ctx, q, err or errno.EFAULT)
            done += moved

    def _bounced(self, fn, what: str, ctx, q: int, local: int, remote: int, nbytes: int) -> None:
        """``_call_one`` in pieces of ``BOUNCE_BYTES`` through this thread's bounce buffer,
        half a page from the remote address (``beside``), and ``memmove`` between it and
        ``local``: both copies are then far from a slow offset."""
        for done in range(0, nbytes, BOUNCE_BYTES):
            size = min(BOUNCE_BYTES, nbytes - done)
            there = address(beside(remote + done, size))
            if what == "read":
                self._call_one(fn, what, ctx, q, there, remote + done, size)
                ctypes.memmove(local + done, there, size)
            else:
                ctypes.memmove(there, local + done, size)
                self._call_one(fn, what, ctx, q, there, remote + done, size)

    def scratch(self, nbytes: int, like: int = 0) -> np.ndarray:
        """A reusable private buffer of ``nbytes`` bytes (a numpy uint8 array) that starts at
        the same offset in its page as address ``like`` (then reads from ``like`` into it
        are never at a slow offset)."""
        if self._scratch is None or self._scratch.size < nbytes + PAGE:
            self._scratch = np.empty(nbytes + PAGE, np.uint8)
        start = (like - address(self._scratch)) % PAGE
        return self._scratch[start: start + nbytes]

    def _error(self, what: str, ctx, q: int, err: int) -> Exception:
        who, pid = ctx.members[q], self.pids[q]
        if err == errno.ESRCH:
            return PeerGone(f"{ctx.describe()}: rank {who} (pid {pid}) is gone: its process "
                            "ended during the op", lost_rank=who)
        if err == errno.EFAULT:
            return AbortedError(
                f"{ctx.describe()}: rank {who}'s buffer is no longer mapped in its process (pid {pid}): "
                "it left the op early (see its output); the group is unusable")
        return CmaError(
            f"{ctx.describe()}: cannot {what} rank {who}'s memory (pid {pid}) with process_vm_"
            f"{what}v: {_strerror(err)}. It worked when the group was created; set CHORUS_SHM_CMA=0 "
            "to copy through the shared window instead.")
