"""Cross Memory Attach (CMA): copy straight between this rank's memory and a peer's.

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
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import threading
from collections.abc import Sequence

import numpy as np

from chorus.errors import AbortedError, ChorusError, PeerLostError
from chorus.shm import skew

IOV_MAX = 1024  # iovec entries per call (Linux's UIO_MAXIOV)
_YAMA = "/proc/sys/kernel/yama/ptrace_scope"
_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


class CmaError(ChorusError):
    """A cross-memory read or write failed for a reason other than a lost peer."""


class PeerGone(PeerLostError):
    """The peer's process no longer exists (ESRCH): found before the transport says so."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def enabled() -> bool:
    """False when ``CHORUS_SHM_CMA=0`` (every collective copies through the window)."""
    return os.environ.get("CHORUS_SHM_CMA", "").strip().lower() not in ("0", "off", "false", "no")


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


#: Where the destination of the kernel's copy sits a few bytes past the source, modulo a
#: page (``slow_skew``), the copy is 4-5x slower on the 2-core machine (AMD EPYC, Linux
#: 6.18, ``bench/skew_probe.py``: 256 KiB in 116-121 us at skews of 8-24 bytes, 26-36 us
#: at 0 and from 32), at every size, as user-space copies are below 512 KiB (chorus.shm.skew).  The 16-core
#: Intel host showed no such step (18-22 us at every skew).  Two numpy buffers from the
#: heap sit at random 16-byte offsets, so single copy between them was slow in one run
#: and not the next (an 8 MiB all_reduce of two ranks: 2.3-3.3 ms, or 5.1-5.5 ms).
PAGE = skew.PAGE
#: A piece whose copy would be slow goes through a private buffer in pieces of this size.
BOUNCE_BYTES = skew.BOUNCE_BYTES


def slow_skew(local: int, remote: int, what: str) -> bool:
    """Whether the kernel's copy for a ``what`` ("read" or "write") between these addresses
    would be slow (chorus.shm.skew.slow)."""
    return skew.slow(local, remote) if what == "read" else skew.slow(remote, local)


address = skew.address


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
            n, err = _call(fn, pid, [(ctypes.addressof(got), addr, 8)])
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


def _call(fn, pid: int, pieces: Sequence[tuple[int, int, int]]) -> tuple[int, int]:
    """One call for up to IOV_MAX ``(local address, remote address, bytes)`` pieces:
    (bytes moved, errno)."""
    n = len(pieces)
    local, remote = (_Iovec * n)(), (_Iovec * n)()
    for i, (mine, theirs, size) in enumerate(pieces):
        local[i].base, local[i].len = mine, size
        remote[i].base, remote[i].len = theirs, size
    moved = fn(pid, local, n, remote, n, 0)
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
        self._counting = threading.Lock()  # helper threads (chorus.shm.crew) read at once
        self._iov = threading.local()  # _one's iovecs, one pair per thread
        self._scratch = None

    def read(self, ctx, q: int, pieces: Sequence[tuple[int, int, int]]) -> None:
        """Copy rank ``q``'s memory into ours: ``(local address, remote address, bytes)`` each."""
        self._move(self.readv, "read", ctx, q, pieces)

    def read_one(self, ctx, q: int, local: int, remote: int, nbytes: int) -> None:
        """``read`` of one piece (the inner loop of ops that move many large pieces)."""
        self._one(self.readv, "read", ctx, q, local, remote, nbytes)

    def write_one(self, ctx, q: int, local: int, remote: int, nbytes: int) -> None:
        """``write`` of one piece."""
        self._one(self.writev, "write", ctx, q, local, remote, nbytes)

    def _one(self, fn, what: str, ctx, q: int, local: int, remote: int, nbytes: int) -> None:
        """One piece through this thread's own iovecs (built once, not per call); an error
        or a partial transfer goes on in ``_move``.  Where the kernel's copy would be slow
        (``slow_skew``), the piece goes through this thread's bounce buffer (``_bounced``)."""
        if nbytes <= 0:
            return  # (an empty part of an uneven op: no call, nothing counted)
        if slow_skew(local, remote, what):
            self._bounced(fn, what, ctx, q, local, remote, nbytes)
            return
        self._call_one(fn, what, ctx, q, local, remote, nbytes)

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
            done = max(moved, 0)
            self._move(fn, what, ctx, q, [(local + done, remote + done, nbytes - done)])

    def _bounced(self, fn, what: str, ctx, q: int, local: int, remote: int, nbytes: int) -> None:
        """``_call_one`` in pieces of ``BOUNCE_BYTES`` through this thread's bounce buffer,
        half a page from the remote address (``skew.beside``), and ``memmove`` between it
        and ``local``: both copies are then far from a slow skew (user-space copies have
        the same slow skews)."""
        for done in range(0, nbytes, BOUNCE_BYTES):
            size = min(BOUNCE_BYTES, nbytes - done)
            there = address(skew.beside(remote + done, size))
            if what == "read":
                self._call_one(fn, what, ctx, q, there, remote + done, size)
                ctypes.memmove(local + done, there, size)
            else:
                ctypes.memmove(there, local + done, size)
                self._call_one(fn, what, ctx, q, there, remote + done, size)

    def write(self, ctx, q: int, pieces: Sequence[tuple[int, int, int]]) -> None:
        """Copy our memory into rank ``q``'s: ``(local address, remote address, bytes)`` each."""
        self._move(self.writev, "write", ctx, q, pieces)

    def scratch(self, nbytes: int, like: int = 0) -> np.ndarray:
        """A reusable private buffer of ``nbytes`` bytes (a numpy uint8 array) that starts at
        the same offset in its page as address ``like`` (then reads from ``like`` into it
        are never slowed by ``slow_skew``)."""
        if self._scratch is None or self._scratch.size < nbytes + PAGE:
            self._scratch = np.empty(nbytes + PAGE, np.uint8)
        start = (like - address(self._scratch)) % PAGE
        return self._scratch[start: start + nbytes]

    def _move(self, fn, what: str, ctx, q: int, pieces: Sequence[tuple[int, int, int]]) -> None:
        todo = [p for p in pieces if p[2] > 0]
        while todo:
            batch, todo = todo[:IOV_MAX], todo[IOV_MAX:]
            want = sum(p[2] for p in batch)
            moved, err = _call(fn, self.pids[q], batch)
            with self._counting:
                self.calls += 1
                self.nbytes += max(moved, 0)
            if moved < 0 or (moved == 0 and want):
                raise self._error(what, ctx, q, err or errno.EFAULT)
            if moved < want:  # a partial transfer: go on after the last byte moved
                todo = _advance(batch, moved) + todo

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


def _advance(pieces: list[tuple[int, int, int]], done: int) -> list[tuple[int, int, int]]:
    """``pieces`` without their first ``done`` bytes."""
    rest = []
    for mine, theirs, size in pieces:
        skip = min(done, size)
        done -= skip
        if size > skip:
            rest.append((mine + skip, theirs + skip, size - skip))
    return rest
