"""Channels: a large all_reduce over TCP in several parts at once, each over its own sockets.

One TCP connection moves a ring's bytes at a rate that one thread's copies set: over
loopback on the 16-vCPU host, 3.1 GB/s each way per rank with one socket per neighbour at
W = 2, 5.3 with two and 7.4 with four; 2.3, 3.0 and 3.3 at W = 8; 1.7 at W = 16 whatever
the count, every CPU busy (``tools/tcp_streams.py``,
docs/results/16-vcpu-h200-host/tcp-large/tcp-streams.txt).  As NCCL's socket transport
opens several sockets per peer, a group whose collectives run over TCP opens channels:
``count - 1`` more TCP transports among its members, beside the group's own (channel 0).
An all_reduce of ``n >= CHORUS_TCP_CHANNEL_BYTES`` (4 MiB) per rank then runs as
``min(count, max(2, n // CHORUS_TCP_CHANNEL_BYTES))`` all_reduces of contiguous parts, each
the call's algorithm on its own channel, part 0 in the calling thread and part k in
channel k's thread::

    K = 2, every rank:   data[:n0]  all_reduce on the group's transport     (this thread)
                         data[n0:]  all_reduce on channel 1's connections   (channel 1's thread)
    every rank ends with op over every rank's data, element by element, as before; the
    bits are the same on every rank (each part is one all_reduce of the group).

The rule is measured (docs/results/16-vcpu-h200-host/channels-8954bb7/): two parts lead
at 4 MiB (W = 4: 1.19x gloo's speed, against 0.95x unsplit), and four parts of 2 MiB at
W = 4, 8 MiB ran at 0.97x where two of 4 MiB ran at 1.32x.

Part 0 always travels on the group's own transport, so a member that calls something else
is still met there with a CollectiveMismatchError, and a lost member with PeerLostError.

Opening.  The channels open right after the group's first all_reduce large enough to be
split, inside that op: it completed on this rank, so every member made the same call and
opens them at the same point.  Each member asks for ``CHORUS_TCP_CHANNELS``, or when that
is 0 for what its CPUs allow (its usable CPUs over the ranks on its host, at most 4); the
group takes the least, so every member splits alike; 1 means no channels.  The members
meet through the job's store (keys ``channels/<group id>/...``); groups without one (a
hierarchy's hidden sub-groups, ranks that are threads of one process) have no channels.
A synchronous all_reduce small enough for the TCP lane (chorus.components.tcp_lane)
never reaches them.

Failures.  A part that fails closes the channels: the others' pending transfers fail at
once, the op raises part 0's error if it has one (its transport settles a mismatch), else
the first part's; every later all_reduce that would use them raises AbortedError naming
that first error, since the members may no longer agree on the split.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable

from chorus import config
from chorus.engine import Workspace
from chorus.errors import AbortedError
from chorus.host import cpus
from chorus.schedules.chunks import offsets, split
from chorus.store import PrefixStore
from chorus.transport.waiting import WaitReport

MOST_AUTO = 4  # channels a member asks for when CHORUS_TCP_CHANNELS is 0, at most


def wanted_channels(world_size: int) -> int:
    """The channels this rank asks for: ``CHORUS_TCP_CHANNELS``, or when that is 0 its
    usable CPUs over the ranks on its host, between 1 and MOST_AUTO."""
    asked = config.get("CHORUS_TCP_CHANNELS")
    if asked:
        return asked
    return max(1, min(MOST_AUTO, cpus.usable() // cpus.ranks_here(world_size)))


def for_group(pg, store) -> Channels | None:
    """``pg``'s channels, or None where it can have none (no store, one member, a
    transport other than TCP, or CHORUS_TCP_CHANNELS=1)."""
    if store is None or pg.size() < 2 or getattr(pg.transport, "name", "") != "tcp":
        return None
    if config.get("CHORUS_TCP_CHANNELS") == 1:
        return None
    return Channels(pg, store)


class _Worker:
    """One thread that runs one channel's parts, in order."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            try:
                fn()
            except BaseException as exc:  # handed to the calling thread, raised there
                future.set_exception(exc)
            else:
                future.set_result(None)


class Channels:
    """A group's extra TCP transports for large all_reduces (see the module docstring)."""

    def __init__(self, pg, store):
        self.pg = pg
        self.store = PrefixStore(f"channels/{pg.id}", store)
        self.min_bytes = config.get("CHORUS_TCP_CHANNEL_BYTES")
        self.count: int | None = None  # agreed when they open; 1: none
        self.transports: list = []  # channels 1 .. count - 1
        self.workers: list[_Worker] = []
        self.workspaces: list[Workspace] = []  # each channel's receive temporaries
        self.broken: BaseException | None = None
        self._closed = False

    def parts(self, nbytes: int) -> int:
        """In how many parts an all_reduce of ``nbytes`` per rank runs now (1: unsplit)."""
        if self.count is None or nbytes < self.min_bytes:
            return 1
        return min(self.count, max(2, nbytes // self.min_bytes))

    def should_open(self, nbytes: int) -> bool:
        """Whether an all_reduce of ``nbytes`` per rank that just completed opens them."""
        return self.count is None and self.broken is None and nbytes >= self.min_bytes

    def open(self, timeout: float) -> None:
        """Agree on the count with the other members and connect (every member calls this
        after the same op; see Opening in the module docstring)."""
        pg = self.pg
        rank, size = pg.rank(), pg.size()
        try:
            self.store.set(f"wants/{rank}", str(wanted_channels(pg.transport.world_size)))
            counts = [int(v) for v in self.store.multi_get([f"wants/{r}" for r in range(size)])]
            count = min(counts)
            for k in range(1, count):
                transport = pg.transport.sibling(rank, size, PrefixStore(str(k), self.store), timeout)
                transport.register_group(pg.id, range(size), WaitReport(
                    pg.members[rank], f"{pg.name} (channel {k})", config.get("CHORUS_WAIT_REPORT_S")))
                self.transports.append(transport)
                self.workers.append(_Worker(f"chorus-group{pg.id}-channel{k}"))
                self.workspaces.append(Workspace())
        except BaseException as exc:
            self._break(exc)
            raise
        self.count = count

    def run(self, count: int, total: int, run_part: Callable[[int, int, int, object], None]) -> None:
        """Run ``run_part(k, offset, size, transport)`` for the ``count`` parts of ``total``
        elements, part k on channel k (None: the group's own transport), at once."""
        if self.broken is not None:
            raise AbortedError(
                f"all_reduce on group {self.pg.name}: its TCP channels closed when an earlier "
                f"all_reduce failed ({type(self.broken).__name__}: {self.broken}); destroy the group "
                "(or re-initialise) and create it again") from None
        sizes = split(total, count)
        starts = offsets(sizes)
        futures = [self.workers[k - 1].submit(
            lambda k=k, transport=self.transports[k - 1]: run_part(k, starts[k], sizes[k], transport))
            for k in range(1, count)]
        first: BaseException | None = None
        try:
            run_part(0, 0, sizes[0], None)
        except BaseException as exc:
            first = exc
            self._break(exc)
        for future in futures:
            exc = future.exception()
            if exc is not None and first is None:
                first = exc
                self._break(exc)
        if first is not None:
            raise first

    def _break(self, exc: BaseException) -> None:
        """Close the channels after ``exc``: pending transfers on them fail at once."""
        if self.broken is None:
            self.broken = exc
        self._close_transports()

    def _close_transports(self) -> None:
        transports, self.transports = self.transports, []
        workers, self.workers = self.workers, []
        for transport in transports:
            transport.close()
        for worker in workers:
            worker.stop()

    def close(self) -> None:
        """The group is destroyed: say BYE on every channel and stop their threads."""
        if not self._closed:
            self._closed = True
            self._close_transports()
