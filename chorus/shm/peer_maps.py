"""The peers' registered buffers (chorus.shm.registered), mapped into this process.

A peer publishes a registered buffer as (fd, device, inode, offset) in its control line
(chorus.shm.window.Window.publish_mapped); this rank opens ``/proc/<pid>/fd/<fd>`` once,
checks that the file is the one the peer named (device and inode), maps the whole file
and keeps the mapping for the next ops on the same buffer (DDP all-reduces the same
buckets every step; a benchmark cycles through a batch of buffers).  A mapping keeps the
peer's file alive, so whenever a new file is mapped, those the peer no longer has open
(``/proc/<pid>/fd/<fd>`` gone or another file) are let go; beyond ``KEEP`` per peer the
least recently used go as well.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict

import numpy as np

from chorus.errors import ChorusError
from chorus.shm.cma import PeerGone
from chorus.shm.registered import Descriptor

#: Files of a peer kept mapped at most.
KEEP = 64


class MapError(ChorusError):
    """A peer's registered buffer could not be mapped."""


class PeerMaps:
    """Rank-indexed caches of mapped peer files; ``pids[q]``: rank q's process id,
    ``members[q]`` its global rank."""

    def __init__(self, pids: list[int], members: tuple[int, ...]):
        self.pids = pids
        self.members = members
        # per rank: (device, inode) -> (the peer's descriptor number, the mapping), least recently used first
        self._maps: list[OrderedDict[tuple[int, int], tuple[int, mmap.mmap]]] = [OrderedDict() for _ in pids]

    def view(self, q: int, where: Descriptor, count: int, dtype: np.dtype) -> np.ndarray:
        """``count`` elements of ``dtype`` at ``where`` in rank ``q``'s memory."""
        cache, key = self._maps[q], (where.device, where.inode)
        known = cache.get(key)
        end = where.offset + count * dtype.itemsize
        if known is None or known[0] != where.fd or len(known[1]) < end:
            self._forget_closed(q)
            known = cache[key] = (where.fd, self._map(q, where, end))
            while len(cache) > KEEP:
                cache.popitem(last=False)  # unmapped once the last view of it is gone
        cache.move_to_end(key)
        return np.frombuffer(known[1], dtype, count, where.offset)

    def _forget_closed(self, q: int) -> None:
        """Let go of rank ``q``'s files that it no longer has open."""
        cache = self._maps[q]
        for key, (fd, _) in list(cache.items()):
            try:
                info = os.stat(f"/proc/{self.pids[q]}/fd/{fd}")
                still = (info.st_dev, info.st_ino) == key
            except OSError:
                still = False
            if not still:
                del cache[key]

    def mapped(self, q: int) -> int:
        """How many of rank ``q``'s files are mapped here."""
        return len(self._maps[q])

    def _map(self, q: int, where: Descriptor, end: int) -> mmap.mmap:
        path = f"/proc/{self.pids[q]}/fd/{where.fd}"
        try:
            handle = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            if not _running(self.pids[q]):
                raise PeerGone(f"group rank {q} (global rank {self.members[q]}) died: its process "
                               f"{self.pids[q]} is gone", lost_rank=self.members[q]) from None
            raise MapError(f"group rank {q}'s registered buffer {path} is gone: it closed the buffer "
                           "during the op") from None
        except OSError as exc:
            raise MapError(
                f"cannot open group rank {q}'s registered buffer {path}: {exc}. "
                "Set CHORUS_SHM_MAPPED=0 on every rank to move such buffers through the window instead") from exc
        try:
            info = os.fstat(handle)
            if (info.st_dev, info.st_ino) != (where.device, where.inode) or info.st_size < end:
                raise MapError(
                    f"group rank {q}'s registered buffer {path} is not the file it announced "
                    f"(device {info.st_dev}, inode {info.st_ino}, {info.st_size} bytes; expected device "
                    f"{where.device}, inode {where.inode}, at least {end} bytes); it changed during the op")
            return mmap.mmap(handle, info.st_size)
        finally:
            os.close(handle)

    def close(self) -> None:
        """Forget every mapping (each goes when the last view of it does)."""
        for cache in self._maps:
            cache.clear()


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is neither a zombie nor dead (a killed process
    keeps its /proc entry, without descriptors, until its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2: stat.rindex(b")") + 3] not in (b"Z", b"X")
