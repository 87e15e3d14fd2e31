"""The peers' registered buffers (chorus.shm.registered), mapped into this process.

A peer publishes a registered buffer as (fd, inode, offset) in its control line
(chorus.shm.window.Window.publish_mapped); this rank opens ``/proc/<pid>/fd/<fd>``
once, checks that the file is the inode the peer named, maps the whole file and keeps
the mapping for the next ops on the same buffer (DDP all-reduces the same buckets every
step; a benchmark cycles through a batch of buffers).  A mapping keeps the peer's file
alive, so when more than ``CHECK`` files of a peer are mapped, those the peer no longer
has open (``/proc/<pid>/fd/<fd>`` gone or another file) are let go; beyond ``KEEP`` the
least recently used go as well.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict

import numpy as np

from chorus.errors import ChorusError, PeerLostError

#: Files of a peer mapped before those it closed are looked for, and the most kept.
CHECK, KEEP = 8, 64


class MapError(ChorusError):
    """A peer's registered buffer could not be mapped."""


class PeerMaps:
    """Rank-indexed caches of mapped peer files; ``pids[q]``: rank q's process id."""

    def __init__(self, pids: list[int], members: tuple[int, ...]):
        self.pids = pids
        self.members = members
        # per rank: inode -> (the peer's descriptor number, the mapping), least recently used first
        self._maps: list[OrderedDict[int, tuple[int, mmap.mmap]]] = [OrderedDict() for _ in pids]

    def view(self, q: int, fd: int, inode: int, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` elements of ``dtype`` at byte ``offset`` of rank ``q``'s file (fd, inode)."""
        cache = self._maps[q]
        known = cache.get(inode)
        end = offset + count * dtype.itemsize
        if known is None or len(known[1]) < end:
            if len(cache) >= CHECK:
                self._forget_closed(q)
            known = cache[inode] = (fd, self._map(q, fd, inode, end))
            while len(cache) > KEEP:
                cache.popitem(last=False)  # unmapped once the last view of it is gone
        cache.move_to_end(inode)
        return np.frombuffer(known[1], dtype, count, offset)

    def _forget_closed(self, q: int) -> None:
        """Let go of rank ``q``'s files that it no longer has open."""
        cache = self._maps[q]
        for inode, (fd, _) in list(cache.items()):
            try:
                still = os.stat(f"/proc/{self.pids[q]}/fd/{fd}").st_ino == inode
            except OSError:
                still = False
            if not still:
                del cache[inode]

    def mapped(self, q: int) -> int:
        """How many of rank ``q``'s files are mapped here."""
        return len(self._maps[q])

    def _map(self, q: int, fd: int, inode: int, end: int) -> mmap.mmap:
        path = f"/proc/{self.pids[q]}/fd/{fd}"
        try:
            handle = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise PeerLostError(
                f"group rank {q} (global rank {self.members[q]}): its registered buffer {path} is gone; "
                "the process exited or closed the buffer during the op") from None
        except OSError as exc:
            raise MapError(
                f"cannot open group rank {q}'s registered buffer {path}: {exc}. "
                "Set CHORUS_SHM_MAPPED=0 to move such buffers through the window instead") from exc
        try:
            info = os.fstat(handle)
            if info.st_ino != inode or info.st_size < end:
                raise MapError(
                    f"group rank {q}'s registered buffer {path} is not the file it announced "
                    f"(inode {info.st_ino} of {info.st_size} bytes, expected inode {inode} of at "
                    f"least {end}); it changed during the op")
            return mmap.mmap(handle, info.st_size)
        finally:
            os.close(handle)

    def close(self) -> None:
        """Forget every mapping (each goes when the last view of it does)."""
        for cache in self._maps:
            cache.clear()
