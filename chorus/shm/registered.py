"""Registered buffers: a rank's own memory that lives in a shareable file.

Most buffers a collective gets are private memory (numpy's, torch's allocator), which a
peer can reach only through the kernel (chorus.shm.cma) or through copies into the
window.  A buffer that lives in a shared-memory file can instead be mapped by the peers
once and then read and written with plain loads and stores (chorus.shm.mapped): the
fastest way one host has to move a byte between processes.

This module keeps the list of such buffers in this process::

    register(address, nbytes, fd, alive)   [address, address + nbytes) is file ``fd``'s
                                           bytes from offset 0, while ``alive()`` is true
    find(array)                            the Descriptor of the registered buffer that
                                           holds ``array`` (fd, inode, byte offset), or None
    find_start(address)                    whether a registered buffer starts there
    empty_shared(shape, dtype)             a new numpy array in a fresh shared file,
                                           registered for as long as the array lives

chorus.torch registers the storage of a CPU tensor that a group all-reduces again and
again (DDP's gradient buckets) after moving it into shared memory with torch's own
``share_memory_`` machinery.  A registration names the file by descriptor number and
inode: a peer opens ``/proc/<pid>/fd/<fd>`` (allowed where ptrace would be, as for
chorus.shm.cma) and checks the inode.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from chorus.shm import cma

#: Descriptor numbers and offsets are packed into one 64-bit word of the window
#: (chorus.shm.window.Window.publish_mapped): ``fd << OFFSET_BITS | offset``.
OFFSET_BITS = 40


@dataclass(frozen=True)
class Descriptor:
    """Where a registered buffer's bytes are: file ``fd`` (``device`` and ``inode``: memfds
    and /dev/shm files number their inodes apart) from byte ``offset``."""

    fd: int
    device: int
    inode: int
    offset: int


@dataclass(frozen=True)
class _Entry:
    start: int
    end: int
    fd: int
    device: int
    inode: int
    alive: Callable[[], bool]


_SWEEP_AT = 256  # registrations from which a new one first drops those whose buffers died
_lock = threading.Lock()
_starts: list[int] = []  # sorted start addresses of _entries' buffers
_entries: dict[int, _Entry] = {}


def register(address: int, nbytes: int, fd: int, alive: Callable[[], bool]) -> None:
    """Record that the ``nbytes`` at ``address`` are the first bytes of the file open as
    ``fd`` (shared with the peers), for as long as ``alive()`` returns true.  A buffer
    registered at the same address before is replaced."""
    info = os.fstat(fd)
    if info.st_size < nbytes:
        raise ValueError(f"registered buffer of {nbytes} bytes in a file of {info.st_size}")
    if fd >> (64 - OFFSET_BITS):
        return  # a descriptor number the window cannot carry: stay unregistered
    if len(_entries) >= _SWEEP_AT:
        for dead in [e.start for e in list(_entries.values()) if not e.alive()]:
            unregister(dead)  # buffers that died where nothing was registered again since
    with _lock:
        if address not in _entries:
            bisect.insort(_starts, address)
        _entries[address] = _Entry(address, address + nbytes, fd, info.st_dev, info.st_ino, alive)


def unregister(address: int) -> None:
    with _lock:
        if _entries.pop(address, None) is not None:
            del _starts[bisect.bisect_left(_starts, address)]


def find(array: np.ndarray) -> Descriptor | None:
    """The registered buffer holding all of ``array`` (C-contiguous), or None."""
    start = cma.address(array)
    with _lock:
        i = bisect.bisect_right(_starts, start) - 1
        entry = _entries.get(_starts[i]) if i >= 0 else None
    if entry is None or start + array.nbytes > entry.end:
        return None
    if not entry.alive() or not _same_file(entry):
        unregister(entry.start)
        return None
    offset = start - entry.start
    if offset >> OFFSET_BITS:
        return None
    return Descriptor(entry.fd, entry.device, entry.inode, offset)


def find_start(address: int) -> bool:
    """Whether a live registered buffer starts at ``address``."""
    entry = _entries.get(address)
    if entry is None:
        return False
    if not entry.alive() or not _same_file(entry):
        unregister(address)
        return False
    return True


def _same_file(entry: _Entry) -> bool:
    try:
        info = os.fstat(entry.fd)
        return (info.st_dev, info.st_ino) == (entry.device, entry.inode)
    except OSError:
        return False


def empty_shared(shape, dtype=np.float32) -> np.ndarray:
    """A new, uninitialised numpy array in its own shared-memory file (``memfd``),
    registered: the shared-memory collectives move it with plain loads and stores
    between ranks of one host (chorus.shm.mapped).  Use it for buffers that are
    communicated again and again.

    every rank: buf = chorus.empty_shared(1 << 20); buf[:] = grads; chorus.all_reduce(buf)
      -> every rank's buf holds the sum; keep buf and reuse it for the next all_reduce
    """
    dtype = np.dtype(dtype)
    nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    fd = os.memfd_create("chorus-registered", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        area = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    root = np.frombuffer(area, dtype, int(np.prod(shape, dtype=np.int64)))
    address = root.__array_interface__["data"][0]
    alive = weakref.ref(root)
    register(address, nbytes, fd, lambda: alive() is not None)
    # On the root array, whose views all keep it: numpy runs its weakref callbacks before
    # it lets go of the mapping, so the registration never outlives the memory.
    weakref.finalize(root, _release, address, fd)
    return root.reshape(shape)


def _release(address: int, fd: int) -> None:
    unregister(address)
    os.close(fd)
