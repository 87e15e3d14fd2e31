"""Collectives on registered buffers: every rank maps every other rank's buffer.

When every rank's buffer of an op lives in a shared file (chorus.shm.registered: torch
CPU tensors that chorus.torch moved there, arrays from ``chorus.empty_shared``),
the ranks map each other's buffers (``PeerMaps``) and move the data with plain
loads and stores: no copy through the window, no system call per op.  An all_reduce
then reads every byte once and writes every byte once, the least any all_reduce can
move through memory::

    phase 0   rank r:  offer its buffer (fd, inode, offset)      (control line, MAPPED)
                       + what the fallback's phase 0 needs        (chorus.shm.collectives)
    sync      (checks every rank called the same op; all offered a buffer?  else the
              fallback goes on from here, and this module is not used)
    phase 1   rank r, piece k of slice r (``PIECE_BYTES``):
                  acc <- reduce(rank 0's data[k], ..., rank W-1's data[k])
                  rank q's data[k] <- acc                 for every q (reduce: the root)
    sync      nobody returns while others still read or write its data
              (chorus.shm.direct.closing)

Nothing races in phase 1: slice r of every rank's buffer is read and then written by
rank r alone.  ``acc`` is a private piece that stays in cache, so each byte of the
buffers crosses memory once each way; the rows are reduced in rank order by the same
reducer as the other paths (chorus.reductions), pieces of at least 64 KiB.

all_to_all offers its input: in phase 1 each rank copies its blocks out of the peers'
mapped inputs into its output (chorus.shm.collectives.all_to_all).

A peer that dies leaves its file mapped here: late writes land in memory nobody reads,
and the closing sync reports the death (PeerLostError).

*Mapping the peers' buffers* (``PeerMaps``).  A peer publishes a registered buffer as (fd,
device, inode, offset) in its control line (chorus.shm.window.Window.publish_mapped);
this rank opens ``/proc/<pid>/fd/<fd>`` once, checks that the file is the one the peer
named (device and inode), maps the whole file and keeps the mapping for the next ops on
the same buffer (DDP all-reduces the same buckets every step; a benchmark cycles through
a batch of buffers).  A mapping keeps the peer's file alive, so whenever a new file is
mapped, those the peer no longer has open (``/proc/<pid>/fd/<fd>`` gone or another file)
are let go; beyond ``KEEP`` per peer the least recently used go as well.

With a recorder attached (chorus.recorder), each rank's share of an all_reduce reports a
``reduce`` event, and each block an all_to_all reads a ``copy`` event naming the peer.
"""

from __future__ import annotations

import mmap
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from chorus import recorder
from chorus.errors import ChorusError
from chorus.shm import cma, direct
from chorus.shm.phases import Reduce, offsets, part_of, parts_for, sub
from chorus.shm.registered import Descriptor
from chorus.shm.window import Window

#: Elements of a rank's slice reduced at a time: a private piece that stays in cache.
PIECE_BYTES = 256 << 10
#: Files of a peer kept mapped at most.
KEEP = 64


def use(win: Window, nbytes: int, op: str = "all_reduce") -> bool:
    """Whether ``op`` (all_reduce, reduce, all_to_all) of ``nbytes`` may run on registered
    buffers: the window's verdict, and the size.  all_reduce and reduce from
    ``CHORUS_SHM_MAPPED_BYTES`` (1 MiB; 0 or ``CHORUS_SHM_MAPPED=0``: never): at W = 8
    (``git show 5907f47^:bench/ab_probe.py``, "reg" against "copy", medians of 7) 0.33 ms
    at 1 MiB against 0.56 for the copy path, 0.69 against 1.65 at 4 MiB.  all_to_all from
    4 MiB unless that setting is given (the same runs: 0.36-0.44 ms at 1 MiB against the
    copy path's 0.38, 0.75 against 1.23 at 4 MiB; single copy 0.93)."""
    s = win.settings
    least = s.all_to_all_bytes if op == "all_to_all" else s.mapped_bytes
    return win.maps is not None and least > 0 and nbytes >= least


def buffers(win: Window, data: np.ndarray, where: list[Descriptor],
            sizes: Sequence[int] | None = None) -> list[np.ndarray]:
    """Every rank's buffer of the op as a flat array of ``data``'s dtype, of ``sizes[q]``
    elements (default: ``data``'s size); this rank's is ``data``."""
    return [data if q == win.rank else
            win.maps.view(q, d, data.size if sizes is None else sizes[q], data.dtype)
            for q, d in enumerate(where)]


def all_reduce(win: Window, ctx, data: np.ndarray, reduce: Reduce, root: int, where: list[Descriptor]) -> None:
    """Phase 1 of all_reduce (``root`` < 0) or reduce on registered buffers (see above)."""
    me, w = win.rank, win.world
    views = buffers(win, data, where)
    writes = range(w) if root < 0 else (root,)
    lo, hi = part_of(data.size, me, w)
    piece = max(1, PIECE_BYTES // data.itemsize)

    def run(a: int, b: int) -> None:
        start = time.perf_counter() if recorder.current is not None else 0.0
        acc = np.empty(min(piece, b - a), data.dtype)
        for k in range(a, b, piece):
            out = acc[: min(piece, b - k)]
            reduce([v[k: k + out.size] for v in views], out)
            for q in writes:
                if q == me or not win.gave_up(q, ctx.seq):  # a rank that gave up owns its buffer again
                    views[q][k: k + out.size] = out
        if start and b > a:
            recorder.transfer("reduce", ctx, "shm", start, w * (b - a) * data.itemsize, writes=len(writes))

    _split(win, lo, hi, data.itemsize, run)


def all_to_all(win: Window, ctx, inp: np.ndarray, out: np.ndarray, send_table: np.ndarray,
               recv_counts: Sequence[int], where: list[Descriptor]) -> None:
    """Phase 1 of all_to_all on registered inputs: ``out[block q] <- rank q's inp[block me]``
    for every q, read from the mapped inputs (``send_table[q]``: rank q's send counts)."""
    me, w = win.rank, win.world
    recvs = offsets(recv_counts)
    starts = [int(send_table[q, :me].sum()) for q in range(w)]
    views = buffers(win, inp, where, [int(send_table[q].sum()) for q in range(w)])

    def read_block(q: int, part: int, parts: int) -> None:
        a, b = part_of(recv_counts[q], part, parts)
        start = time.perf_counter() if recorder.current is not None else 0.0
        cma.copy(out[recvs[q] + a: recvs[q] + b], views[q][starts[q] + a: starts[q] + b])
        if start and b > a:
            recorder.transfer("copy", ctx, "shm", start, (b - a) * out.itemsize, ctx.members[q])

    direct.from_peers(win, read_block, out.nbytes, lambda: read_block(me, 0, 1))


def _split(win: Window, lo: int, hi: int, itemsize: int, run: Callable[[int, int], None]) -> None:
    """``run(a, b)`` over [lo, hi), in parts on the crew's threads from the copy path's
    ``CHORUS_SHM_COPY_CREW_BYTES`` (below, waking helpers cost more than they gave: 0.51
    against 0.33 ms at 1 MiB, W = 8, the runs that ``use`` cites)."""
    moved = (hi - lo) * itemsize * win.world  # read from every rank, and written to every rank
    parts = parts_for(win, moved, message=moved)
    if parts <= 1:
        run(lo, hi)
        return
    spans = [sub(lo, hi, t, parts) for t in range(parts)]
    win.crew.run([lambda a=a, b=b: run(a, b) for a, b in spans])


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
                raise cma.PeerGone(f"group rank {q} (global rank {self.members[q]}) died: its process "
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
