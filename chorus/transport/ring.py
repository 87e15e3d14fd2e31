"""A single-producer / single-consumer byte ring in shared memory.

One ring carries one ordered stream of bytes from one writer thread (of one process) to
one reader thread (of another).  It is the data path of a same-host TCP connection
(``chorus.transport.shm_link``): frame headers still travel over the socket, large
payloads through here, so message order, matching and failures stay the socket's::

    offset   size    what
    0        128 B   HEAD    bytes ever written (u64); written only by the writer
    128      128 B   TAIL    bytes ever consumed (u64); written only by the reader
    256      128 B   SLEEPS  times the reader went to sleep (u64); written only by the reader
    4 KiB    R       data    byte i of the stream lives at data[i % R]

    free = R - (HEAD - TAIL)        what the writer may fill
    used = HEAD - TAIL              what the reader may take

The writer copies at most ``piece`` bytes, then raises HEAD; the reader copies at most
``piece`` bytes out, then raises TAIL — so a large message streams through a ring much
smaller than itself, both copies running at once (numpy's copies release the GIL).
Counters only grow (64 bits: no wrap in practice) and each has one writer; the stores
are plain aligned 8-byte stores.  x86 keeps stores in order and loads in order, so a
reader that sees HEAD also sees the bytes written before it, and a writer that sees
TAIL knows the reader is done with the bytes before it (the window's counters rely on
the same, chorus.shm.sync).  A stale value only makes a side wait a little longer.

Waiting.  The writer, facing a full ring, yields for ``yield_s`` then sleeps 50 µs
doubling to 1 ms, and every 2 ms calls ``check()``, which raises when the reader can
never drain the ring (its process died or left); given a patience, a writer whose ring
stayed full that long returns how far it got, and a later call goes on from there.  The reader must not burn a core
either, nor sleep through the data: after ``yield_s`` it raises SLEEPS and calls
``doze(seconds)``, which blocks on the connection's socket; a writer that raises HEAD
and sees SLEEPS changed since it last looked rings ``bell()`` (a HEARTBEAT frame on the
socket, which wakes the reader).  Both sides put a full memory barrier between their
store and their load (x86 may otherwise let each load pass its own earlier store, and
both miss), and ``doze`` still wakes after 10 ms as a safety net.  The socket also ends
the wait when the writer dies: EOF.  Between messages the reader is not here at all: it
blocks in the socket's ``recv`` for the next header.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import numpy as np

from chorus.errors import ProtocolError

# A waiting end polls, then naps from NAP_MIN doubling to NAP_MAX, and checks the other
# end's liveness every CHECK_S (the same waiting policy as the shared-memory window's
# syncs, chorus.shm.sync).
CHECK_S = 0.002
NAP_MIN, NAP_MAX = 50e-6, 1e-3

CONTROL = 4096  # bytes before the data area
HEAD, TAIL, SLEEPS = 0, 16, 32  # word indices, 128 bytes apart (no shared cache-line pair)
# Each message starts at a stream position of 2 KiB mod 4 KiB, so the copies in and out
# keep source and destination apart mod 4 KiB for buffers at the usual malloc offset (16
# bytes into a page): memcpy's ``rep movsb`` ran 20-30x slower (0.7 GB/s) on an AMD EPYC
# when the destination was 1-31 bytes ahead of the source mod 4 KiB — a page-aligned ring
# read into a page-plus-16 numpy buffer was exactly that.  Costs < 4 KiB of ring a message.
ALIGN, ALIGN_AT = 4096, 2048
DOZE_S = 0.010  # the reader's longest sleep without a bell (a lost bell costs at most this)

_barrier = threading.Lock()


def full_barrier() -> None:
    """A full memory barrier: an uncontended lock's acquire and release are atomic
    read-modify-writes (``lock``-prefixed on x86), which no load or store passes."""
    _barrier.acquire()
    _barrier.release()


def ring_size(data_bytes: int) -> int:
    """Bytes of shared memory one ring of ``data_bytes`` occupies."""
    return CONTROL + data_bytes


def _never() -> None:
    pass


class _Ring:
    """Views of one ring at ``offset`` of ``buf`` (a mapping), and the waiting policy."""

    def __init__(self, buf, offset: int, data_bytes: int, *, piece: int, yield_s: float,
                 check: Callable[[], None] = _never):
        self.size = data_bytes
        self.ctl = memoryview(buf)[offset: offset + CONTROL].cast("Q")
        self.data = np.frombuffer(buf, np.uint8, data_bytes, offset + CONTROL)
        self.piece = max(1, min(piece, data_bytes // 2))
        self.yield_s = yield_s
        self.check = check
        self.bytes = 0  # payload bytes moved through this end (statistics: tests, benches)
        self.sleeps = 0  # times this end slept (statistics)

    def _wait(self, ready: Callable[[], int], patience: float | None = None) -> int:
        """Back off until ``ready()`` is non-zero; return it (0 after ``patience`` seconds)."""
        start = time.monotonic()
        next_check = start + CHECK_S
        nap = NAP_MIN
        while True:
            got = ready()
            if got:
                return got
            now = time.monotonic()
            if now >= next_check:
                self.check()
                next_check = now + CHECK_S
            if patience is not None and now - start >= patience:
                return 0
            if now - start < self.yield_s:
                os.sched_yield()
                continue
            self.sleeps += 1
            self._sleep(ready, nap)
            nap = min(2 * nap, NAP_MAX)

    def _sleep(self, ready: Callable[[], int], nap: float) -> None:
        raise NotImplementedError


class RingWriter(_Ring):
    """The writing end.  One thread at a time (the caller serialises).

    ``bell()`` wakes a sleeping reader (sent while the caller owns the socket)."""

    def __init__(self, buf, offset: int, data_bytes: int, *, bell: Callable[[], None], **waiting):
        super().__init__(buf, offset, data_bytes, **waiting)
        self.bell = bell
        self.head = int(self.ctl[HEAD])
        self.rung = int(self.ctl[SLEEPS])  # the reader's sleep we last rang for

    def _free(self) -> int:
        return self.size - (self.head - self.ctl[TAIL])

    def _sleep(self, ready: Callable[[], int], nap: float) -> None:
        time.sleep(nap)

    def write(self, view: memoryview, announce: Callable[[], None] = _never, done: int = 0,
              patience: float | None = None) -> int:
        """Append one message, ``view`` (any size: it streams through in pieces as the
        reader drains them).  ``announce()`` sends its header: called once the first
        piece is in, so the reader finds data as soon as the header arrives.

        Returns ``len(view)``, or with ``patience`` the bytes in so far once the ring
        stayed full for that many seconds: call again with ``done`` = that to go on
        (``announce`` was called if and only if it is > 0)."""
        src = np.frombuffer(view, np.uint8)
        if not done:
            pad = (ALIGN_AT - self.head) % ALIGN
            while self._free() < pad:
                if not self._wait(lambda: self._free() >= pad, patience):
                    return 0
            self.head += pad  # published with the first piece (0 on a second call)
        n = src.size
        while done < n:
            free = self._free() or self._wait(self._free, patience)
            if not free:
                return done
            first = not done
            done = self._put(src, done, min(free, n - done, self.piece))
            if first:
                announce()
        self.bytes += n
        return n

    def _put(self, src: np.ndarray, done: int, k: int) -> int:
        """Copy ``src[done: done + k]`` in at HEAD, publish it, ring if the reader sleeps."""
        size, data = self.size, self.data
        pos = self.head % size
        first = min(k, size - pos)
        np.copyto(data[pos: pos + first], src[done: done + first])
        if k > first:
            np.copyto(data[: k - first], src[done + first: done + k])
        self.head += k
        self.ctl[HEAD] = self.head  # publish: after the bytes (x86 store order)
        full_barrier()  # ... and before reading SLEEPS
        asleep = self.ctl[SLEEPS]
        if asleep != self.rung:
            self.rung = asleep
            self.bell()
        return done + k


class RingReader(_Ring):
    """The reading end.  One thread at a time (the connection's reader).

    ``doze(seconds)`` blocks on the socket until bytes (a bell) or EOF arrive or the time
    is up; it returns True if a frame other than a bell is waiting there."""

    def __init__(self, buf, offset: int, data_bytes: int, *, doze: Callable[[float], bool],
                 peer: int, **waiting):
        super().__init__(buf, offset, data_bytes, **waiting)
        self.doze = doze
        self.peer = peer
        self.tail = int(self.ctl[TAIL])
        self.asleep = int(self.ctl[SLEEPS])

    def _used(self) -> int:
        return self.ctl[HEAD] - self.tail

    def _sleep(self, ready: Callable[[], int], nap: float) -> None:
        self.asleep += 1
        self.ctl[SLEEPS] = self.asleep  # ask for a bell ...
        full_barrier()
        if ready():  # ... then look again: data published before the writer saw SLEEPS
            return
        if self.doze(DOZE_S) and not ready():
            raise ProtocolError(f"rank {self.peer} sent another frame before the payload of the "
                                "previous one was complete in shared memory")

    def read_into(self, dst: memoryview) -> None:
        """Fill ``dst`` completely with the next message (``len(dst)`` bytes)."""
        out = np.frombuffer(dst, np.uint8)
        self._take(None, (ALIGN_AT - self.tail) % ALIGN)
        self._take(out, out.size)
        self.bytes += out.size

    def discard(self, n: int) -> None:
        """Skip the next message (``n`` bytes)."""
        self._take(None, (ALIGN_AT - self.tail) % ALIGN + n)
        self.bytes += n

    def _take(self, out: np.ndarray | None, n: int) -> None:
        done, size, data, ctl = 0, self.size, self.data, self.ctl
        while done < n:
            used = self._used() or self._wait(self._used)
            k = min(used, n - done, self.piece)
            if out is not None:
                pos = self.tail % size
                first = min(k, size - pos)
                np.copyto(out[done: done + first], data[pos: pos + first])
                if k > first:
                    np.copyto(out[done + first: done + k], data[: k - first])
            done += k
            self.tail += k
            ctl[TAIL] = self.tail  # free the space: after the bytes were read
