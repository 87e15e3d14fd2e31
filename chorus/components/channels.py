"""Channels: a large all_reduce over TCP in several parts at once, each over its own sockets.

One TCP connection moves a ring's bytes at a rate that one thread's copies set: over
loopback on the 16-vCPU host, 3.1 GB/s each way per rank with one socket per neighbour at
W = 2, 5.3 with two and 7.4 with four; 2.3, 3.0 and 3.3 at W = 8; 1.7 at W = 16 whatever
the count, every CPU busy (``tools/tcp_streams.py``,
docs/results/16-vcpu-h200-host/tcp-large/tcp-streams.txt).  As NCCL's socket transport
opens several sockets per peer, a job opens channels: ``count - 1`` more TCP transports
among all its ranks, beside its own (channel 0), made when the job starts.  In a group
whose collectives run over TCP (no shared-memory window, no hierarchy), an all_reduce of
``n`` bytes per rank, at least ``CHORUS_TCP_CHANNEL_BYTES`` (4 MiB) and more than any
rank's ``CHORUS_TCP_LANE_BYTES``, then runs as ``min(count, max(2, n // CHORUS_TCP_CHANNEL_BYTES))``
all_reduces of contiguous parts, each the call's algorithm on its own channel, part 0 in
the calling thread and part k in a thread of the group's for channel k.  A group whose
hosts each hold at most two of its ranks, consecutive, splits the same way the ring it
runs through the hosts from ``CHORUS_HIER_RING_BYTES`` (chorus.components.hierarchy:
part 0's hops inside a host stay on shared memory)::

    K = 2, every rank:   data[:n0]  all_reduce on the job's transport    (this thread)
                         data[n0:]  all_reduce on channel 1's sockets    (the group's channel-1 thread)
    every rank ends with op over every rank's data, element by element, as before; the
    bits are the same on every rank (each part is one all_reduce of the group).

The rule is measured (docs/results/16-vcpu-h200-host/channels-8954bb7/): two parts lead
at 4 MiB (W = 4: 1.19x gloo's speed, against 0.95x unsplit), and four parts of 2 MiB at
W = 4, 8 MiB ran at 0.97x where two of 4 MiB ran at 1.32x.

Agreement.  When the job starts, every rank publishes in the job's store what it asks for
(``CHORUS_TCP_CHANNELS``, 0: as many as its CPUs allow, its usable CPUs over the job's
ranks on its host, at most 4), its host, ``CHORUS_TCP_CHANNEL_BYTES`` and
``CHORUS_TCP_LANE_BYTES``; rank 0 reads the table and publishes the least count, the
largest channel bytes and the largest lane bytes, which every rank takes.  So every rank
splits an op alike, a call the TCP lane may take on some rank is never split, and no split
depends on when a rank issues its calls.  The table also holds each rank's
``CHORUS_SEGMENT_BYTES`` (or that it is unset): where ranks differ, every rank's start
fails naming them, since their ring and chain schedules would cut messages differently.
A count of 1 (one rank asks for 1, no rank has CPUs to spare, or every rank is on one
host and may use shared memory, so no group runs over TCP) opens nothing.

Channels are transports of the job (without shared-memory rings: they carry only split
all_reduces), so their errors name global ranks, and every group registers with them; at
most MOST_PEER_SOCKETS more sockets a rank unless asked for.  The threads that run parts
are the group's own (one per channel), so two groups' ops never wait for each other's
parts.  Part 0 always travels on the job's own transport, so a member that calls
something else is met there with a CollectiveMismatchError as before; every part carries
the op's sequence number and fingerprint, and a lost member fails each channel's part
with PeerLostError.  On a rank, the first part to fail makes that rank's other parts give
up at once (``Transport.abandon``: their receives fail, their late frames are dropped),
part 0 as well unless the failure is one the job's transport learns of by itself (a lost
or departed member, a mismatch); the op raises part 0's error, else the first part's.  The other ranks learn of
a failure as they do of any rank's (a mismatch, a lost member); one that only this rank
saw leaves them waiting until their op's timeout, as an unsplit op would.

Results are the same on every rank, but not the same bits as the unsplit all_reduce's
where the reduction rounds (each part reduces in its own order), and the split depends on
the ranks' CPUs when ``CHORUS_TCP_CHANNELS`` is 0: set it for bit-reproducible runs
across machines.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable

from chorus import config
from chorus.engine import Workspace
from chorus.errors import AbortedError, CollectiveMismatchError, InvalidArgumentError, PeerLostError
from chorus.host import cpus
from chorus.host.identity import NO_HOST, host_digest, transport_mode
from chorus.schedules.chunks import offsets, split
from chorus.store import PrefixStore
from chorus.transport.waiting import WaitReport

log = logging.getLogger("chorus")

MOST_AUTO = 4  # channels a rank asks for when CHORUS_TCP_CHANNELS is 0, at most
MOST_PEER_SOCKETS = 256  # ... and so that it holds at most this many sockets more than without
READ_GRACE_S = 5.0  # how long rank 0 waits for every rank to read a failed agreement before it raises


def agreed(table: list[dict]) -> tuple[int, int, int]:
    """(count, channel bytes, lane bytes) from every rank's entry (``offer`` of each rank,
    in rank order): the least count asked, the largest channel and lane bytes.  A job on
    one host whose ranks all may use shared memory runs no collective over TCP: count 1."""
    hosts: dict[str, int] = {}
    for entry in table:
        hosts[entry["host"]] = hosts.get(entry["host"], 0) + 1
    if len(hosts) == 1 and "" not in hosts and not any(e["tcp"] for e in table):
        return 1, max(e["bytes"] for e in table), max(e["lane"] for e in table)
    most = max(1, 1 + MOST_PEER_SOCKETS // max(1, len(table) - 1))  # (extra sockets a rank holds, when auto)
    counts = []
    for entry in table:
        if entry["asked"]:
            counts.append(entry["asked"])
            continue
        here = entry["local"] if entry["host"] == "" else hosts[entry["host"]]
        counts.append(max(1, min(MOST_AUTO, most, entry["cpus"] // max(1, here))))
    return min(counts), max(e["bytes"] for e in table), max(e["lane"] for e in table)


def offer(rank: int, world_size: int) -> dict:
    """This rank's entry in the agreement (see the module docstring); a rank that cannot
    make one (a setting out of range) offers ``{"error": why}`` instead, so that every
    rank raises it rather than wait for an entry that never comes."""
    try:
        tcp = transport_mode() == "tcp"  # (then no host: its CHORUS_HOST_ID is not read)
        digest = NO_HOST if tcp else host_digest(rank)
        return {"asked": config.get("CHORUS_TCP_CHANNELS"), "cpus": cpus.usable(), "tcp": tcp,
                "host": "" if digest == NO_HOST else digest.hex(), "local": cpus.ranks_here(world_size),
                "bytes": config.get("CHORUS_TCP_CHANNEL_BYTES"), "lane": config.get("CHORUS_TCP_LANE_BYTES"),
                "segment": config.get("CHORUS_SEGMENT_BYTES") if config.is_set("CHORUS_SEGMENT_BYTES") else 0}
    except ValueError as exc:  # ConfigError, or a CHORUS_HOST_ID list too short for this rank
        return {"error": str(exc)}


def segments_differ(table: list[dict]) -> list[tuple[int, str]]:
    """The ranks' CHORUS_SEGMENT_BYTES as an error for every rank (rank, why), where they
    differ (unset on some ranks counts): the ring and chain schedules cut their messages by
    it, so ranks that differ would post receives of other sizes than their peers send."""
    values = [e.get("segment", 0) for e in table]
    if len(set(values)) < 2:
        return []
    said = ", ".join(f"rank {r}: {v if v else 'unset'}" for r, v in enumerate(values))
    return [(0, f"CHORUS_SEGMENT_BYTES differs among the ranks ({said}); set it to one value on every "
                "rank, or on none")]


def open_channels(transport, store, timeout: float) -> Channels | None:
    """The job's channels, or None when the ranks agree on one (every rank of the job calls
    this once, right after its transport is up; ``store``: this start's view of the job's
    store)."""
    if store is None or transport.world_size < 2 or getattr(transport, "name", "") != "tcp":
        return None
    rank, size = transport.rank, transport.world_size
    mine = offer(rank, size)
    store.set(f"channels/offer/{rank}", json.dumps(mine))
    if "error" in mine and rank != 0:  # (rank 0 tells every rank, the store's host may leave soon after)
        store.add("channels/read", 1)  # (nothing to read: rank 0 need not wait for this rank)
        raise InvalidArgumentError(f"init_process_group: rank {rank}: {mine['error']}")
    if rank == 0:  # rank 0 reads every offer and publishes the outcome: O(W) reads, not O(W^2)
        table = [json.loads(v) for v in store.multi_get([f"channels/offer/{r}" for r in range(size)])]
        bad = [(r, e["error"]) for r, e in enumerate(table) if "error" in e] or segments_differ(table)
        outcome = ({"error": "; ".join(f"rank {r}: {why}" for r, why in bad)} if bad
                   else dict(zip(("count", "bytes", "lane"), agreed(table), strict=True)))
        store.set("channels/agreed", json.dumps(outcome))
        if "error" in outcome:  # the store may live in this process: let the others read it first
            until = time.monotonic() + READ_GRACE_S
            while store.add("channels/read", 0) < size - 1 and time.monotonic() < until:
                time.sleep(0.01)
    else:
        outcome = json.loads(store.get("channels/agreed"))
        store.add("channels/read", 1)
    if "error" in outcome:
        raise InvalidArgumentError(f"init_process_group: {outcome['error']}")
    count, min_bytes, floor = outcome["count"], outcome["bytes"], outcome["lane"]
    if count < 2:
        return None
    transports = []
    try:
        for k in range(1, count):
            transports.append(transport.sibling(rank, size, PrefixStore(f"channels/{k}", store), timeout))
    except BaseException:
        for t in transports:
            t.close()
        raise
    return Channels(transports, count, min_bytes, floor)


class Channels:
    """The job's channels 1 .. count - 1 and the rule that splits an all_reduce among them."""

    def __init__(self, transports: list, count: int, min_bytes: int, floor: int):
        self.transports = transports
        self.count = count
        self.min_bytes = min_bytes  # the least all_reduce that is split
        self.floor = floor  # the largest a TCP lane may take unsplit: only larger ones split

    def parts(self, nbytes: int) -> int:
        """In how many parts an all_reduce of ``nbytes`` per rank runs (1: unsplit)."""
        if nbytes < self.min_bytes or nbytes <= self.floor:
            return 1
        return min(self.count, max(2, nbytes // self.min_bytes))

    def close(self) -> None:
        """The job ends: say BYE on every channel (after its groups are destroyed)."""
        transports, self.transports = self.transports, []
        for transport in transports:
            transport.close()


class GroupChannels:
    """One group's use of the job's channels: its threads (made at its first split op)
    and receive temporaries, one per channel."""

    def __init__(self, pg, channels: Channels):
        self.pg = pg
        self.channels = channels
        self.workspaces = [Workspace() for _ in channels.transports]
        # one thread per channel, so a group's parts on a channel run in its order
        self._workers: list[concurrent.futures.ThreadPoolExecutor] = []
        self._lock = threading.Lock()
        self._closed = False
        interval = config.get("CHORUS_WAIT_REPORT_S")
        me = pg.members[pg.rank()]
        for k, transport in enumerate(channels.transports, start=1):
            transport.register_group(pg.id, pg.members, WaitReport(me, f"{pg.name} (channel {k})", interval))

    def parts(self, nbytes: int) -> int:
        return self.channels.parts(nbytes)

    def run(self, ctx, count: int, total: int,
            run_part: Callable[[int, int, int, object, Workspace | None], None]) -> None:
        """Run ``run_part(k, offset, size, transport, workspace)`` for the ``count`` parts
        of ``total`` elements of op ``ctx`` at once: part k on channel k (part 0: transport
        and workspace None, the group's own, in this thread).  The first part to fail makes
        this rank's other parts give up at once (Transport.abandon; part 0 too, unless the
        job's transport learns of that failure itself), and part 0's error is raised, else
        the first part's."""
        sizes = split(total, count)
        starts = offsets(sizes)
        main = self.pg.transport
        transports = self.channels.transports[:count - 1]
        errors: list[BaseException] = []  # in the order the parts failed
        lock = threading.Lock()

        def failed(exc: BaseException) -> None:
            with lock:
                if any(e is exc for e in errors):
                    return
                errors.append(exc)
                if len(errors) > 1:
                    return
            why = f"{ctx.describe()}: another part of this split all_reduce failed ({type(exc).__name__})"
            # A lost or departed member, or a mismatch, reaches the job's transport by itself,
            # with the whole story (the mismatch's calls, the notice before a BYE): part 0
            # goes on to meet it there.  Anything else only this rank knows of.
            told = isinstance(exc, (PeerLostError, CollectiveMismatchError))
            for transport in (transports if told else (main, *transports)):
                try:
                    transport.abandon(ctx.group, ctx.seq, why)
                except Exception:  # noqa: BLE001 - the others must still give up
                    log.exception("chorus: could not abandon %s on a transport", ctx.describe())

        def on_done(future: concurrent.futures.Future) -> None:  # (early: the others give up at once)
            exc = future.exception()
            if exc is not None:
                failed(exc)

        with self._lock:  # (close() cannot slip its stop between these submissions)
            if self._closed:
                raise AbortedError(f"{ctx.describe()}: the group was destroyed")
            if len(transports) < count - 1:
                raise AbortedError(f"{ctx.describe()}: the job's channels are closed "
                                   "(destroy_process_group was called)")
            while len(self._workers) < count - 1:
                self._workers.append(concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"chorus-group{self.pg.id}-channel{len(self._workers) + 1}"))
            futures = []
            for k in range(1, count):
                future = self._workers[k - 1].submit(
                    lambda k=k: run_part(k, starts[k], sizes[k], transports[k - 1], self.workspaces[k - 1]))
                future.add_done_callback(on_done)
                futures.append(future)
        own: BaseException | None = None  # part 0's error
        try:
            run_part(0, 0, sizes[0], None, None)
        except BaseException as exc:
            own = exc
            failed(exc)
        concurrent.futures.wait(futures)
        for future in futures:  # (the source of truth: a done-callback may not have run yet)
            exc = future.exception()
            if exc is not None:
                failed(exc)
        if errors:
            # A transfer of the failed op may still land in these buffers (a payload a
            # reader thread was reading): the next op gets fresh ones.
            self.pg.workspace = Workspace()
            self.workspaces = [Workspace() for _ in self.workspaces]
            if own is not None and not (isinstance(own, AbortedError) and own is not errors[0]):
                raise own  # (the job's transport's account: it settles a mismatch's calls)
            raise errors[0]

    def close(self) -> None:
        """The group is destroyed: its threads end once their queued parts are done."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
            for worker in workers:
                worker.shutdown(wait=False)
