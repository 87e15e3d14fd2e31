"""Hierarchical collectives for a group whose members span hosts: shared memory inside each
host, TCP among one leader per host.

Which groups.  When a group is created its members learn every member's host (the
shared-memory handshake, chorus.shm.handshake).  A group on more than one host with at
least two members on some host gets this component (``pg.hierarchy``), first in its
stack (chorus.components.select): it takes all_reduce, reduce, broadcast, all_gather
(all_gather_into_tensor too), reduce_scatter (reduce_scatter_tensor too) and barrier —
unless ``algorithm=`` or ``CHORUS_ALGO_<NAME>`` (read when the group is created) names a
flat TCP algorithm.  ``algorithm="hierarchical"``
asks for it explicitly.  gather, scatter and all_to_all stay flat.  A group without shared
memory (``CHORUS_TRANSPORT=tcp``, no usable ``/dev/shm`` on some member) has no hierarchy.

Hidden sub-groups, made by each member when the group is created, with ids derived from
the parent's (``HIDDEN | parent id << 12 | index``), so user-visible group numbering is
unchanged and non-members, who never learn the hosts, create nothing::

    hosts a, a, b, b, b (group ranks 0..4); a host's leader is its lowest group rank

    local     host a: [0, 1]   host b: [2, 3, 4]   each with its own shared-memory window
    leaders   [0, 2]                                TCP; only the leaders hold it

    hosts a, a, b, b: hosts of one size also have columns, the ranks at one place on
    every host (a small all_reduce's second phase), TCP, each with a latency lane
    column    [0, 2]   [1, 3]

Every algorithm below is three phases — inside each host, among the leaders, inside each
host again — made of Calls on the sub-groups (``Call.on``), run by the sub-groups' own
components (chorus.components.select), so their algorithm choice, fingerprints and
failure handling apply unchanged.  The whole op is one op of the parent: one sequence
number, issue order on the parent's queue (async_op too), the parent's before/after
hooks (PREMUL_SUM's scaling, AVG's division) run once around the three phases, and a
recorder sees component ``hierarchical`` with one ``phase`` event per sub-group op.

Large all_reduce on hosts of two: the ring through the hosts.  Where each host holds
consecutive group ranks, at most RING_HOST_RANKS (2) of them, an all_reduce of at least
``CHORUS_HIER_RING_BYTES`` (1 MiB) runs the flat ring of chorus.schedules on the group's
own transport (in parts from 4 MiB, below) instead of the phases: a ring that enters and
leaves each host once, its hops inside a host over the pair's shared-memory link (as
NCCL's ring runs through nodes).  Measured on the 16-vCPU host, gloo's flat ring in the
same run, gloo's median time over chorus's, three rounds
(docs/results/16-vcpu-h200-host/: probe-21b50df/,
hosts-ring-6961a7d/, ring-segment-330cf78/ for 8 + 8 phases at 64 MiB,
whole-chunks-5490c1d/ for the third 2 + 2 run)::

    hosts     path     256 KiB   1 MiB   4 MiB   8 MiB   16 MiB   64 MiB
    2 + 2     phases   1.47x     0.99x   0.89x           1.03x    0.98x
    2 + 2     ring     1.25x     1.05x   1.04x           1.14x    1.29x
    2 + 2     ring               1.13x           1.11x            1.18x    (second run)
    2 + 2     ring               0.57x                                     (third run, five rounds)
    4 + 4     phases             1.75x           1.18x            1.26x
    4 + 4     ring               1.10x           1.01x            1.18x
    8 + 8     phases             6.00x           2.06x            1.40x
    8 + 8     ring               2.01x           1.13x            0.97x

The third 2 + 2 run's rounds at 1 MiB were 1.28x, then 0.84x, 0.55x, 0.56x and 0.66x
(chorus taking twice its first round's time, gloo not): a slow mode of the ring at that
size on that host, not understood.  Four later runs of 1 MiB alone did not repeat it
(0.75-1.12x per round; the phases 0.75-1.07x, hosts-1m-5b63e6f/), and since a thread
waiting for a payload of its same-host peer's shared-memory ring reads it itself, every
round of two runs led gloo, 1.02-2.33x (lone-ring-5b63e6f/).

Where the job has channels (chorus.components.channels: ranks with CPUs to spare), the
ring runs in parts from ``CHORUS_TCP_CHANNEL_BYTES`` (4 MiB, and above every rank's TCP
lane), as an all_reduce of a group without shared memory does: part 0 on the group's
transport, its hops inside a host through shared memory, part k on channel k's sockets.
Only this ring splits: a flat algorithm forced on the group runs whole.  Hosts 2 + 2,
gloo's time over chorus's (docs/results/16-vcpu-h200-host/hosts-channels-135e7d0/,
medians of the rounds): 1.03x and 1.03x at 4 MiB, 1.23x and 1.19x at 8 MiB (five rounds
each), 1.48x at 16 MiB and 1.65x at 64 MiB (three rounds); the whole ring's medians were
0.93x and 0.95x at 4 MiB (many-ops-705de3f/), 1.16x at 8 MiB and 1.16x at 64 MiB
(check-2b18f00/).  Parts of 1 or 2 MiB were slower at every size.

Two ranks per host gain little from the phases (each moves half the data across hosts,
after and before a whole shared-memory phase); with more, the columns carry ever smaller
blocks and the phases lead.

A rank that runs an op as phases first tells its transport that no frame of that op comes
on the group itself (``Transport.elsewhere``), so a rank that runs the same op as the
ring (another count, or another ``CHORUS_HIER_RING_BYTES``) is a mismatch seen at its
first frame; whenever the group itself breaks, its sub-groups are marked broken too (a
failure listener), so no rank waits in a phase for its timeout.
``algorithm="hierarchical"`` runs the phases at every size.

Results.  Every rank gets the same bits (leaders all_reduce bit-identically, then
broadcast).  They equal the flat algorithms' wherever the reduction is exact; with
rounding the order differs (each host first, then across hosts), as it does between any
two flat algorithms.

Failures.  The sub-groups are registered with the transport under the *parent's*
members, so a member dying anywhere fails every phase on every rank (PeerLostError).  A
collective mismatch is seen in whichever phase meets the differing calls; a rank that
sees one marks its other sub-groups broken too (the transport tells their members), so
ranks waiting in another phase raise CollectiveMismatchError instead of waiting for the
timeout, which applies to each phase.  Each rank then raises the *group's* mismatch,
naming the calls its members made (not the phases' calls), after telling every member
its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from chorus import config, recorder
from chorus.call import Call
from chorus.components.base import Component, run_in_order
from chorus.components.channels import GroupChannels
from chorus.components.schedules import ScheduleComponent, forced_algorithms
from chorus.components.tcp_lane import TcpLane
from chorus.errors import CollectiveMismatchError, PeerLostError
from chorus.process_group import ProcessGroup
from chorus.selection import HIERARCHICAL
from chorus.wire.dtypes import DTYPE_CODES
from chorus.work import Work

log = logging.getLogger("chorus")

#: a small all_reduce runs in two phases, in each host then in each column (see all_reduce):
#: one TCP message per step for every rank instead of three phases' latency; each column
#: carries the whole message between hosts, so larger ones split it among the columns
COLUMN_BYTES = 64 * 1024
HIDDEN = 1 << 31  # sub-group ids: HIDDEN | parent id << 12 | (0: leaders, 1 + h: host h, then rails, columns)
_INDEX_BITS = 12
RING = "ring"
RING_HOST_RANKS = 2  # hosts of at most this many ranks run a large all_reduce as the ring (see above)


def build(pg: ProcessGroup, hosts: tuple[int | None, ...], attach: Callable) -> Hierarchy | None:
    """``pg``'s Hierarchy (creating its sub-groups), or None when there is nothing to split.

    ``hosts[r]``: group rank r's host, numbered in order of first appearance (None: no
    shared memory).  Every member calls this, with the same ``hosts``.  ``attach(sub,
    settings=False)`` gives the host-local sub-group its components
    (chorus.components.select.attach).
    """
    if None in hosts or len(set(hosts)) in (1, len(hosts)):
        return None  # no shared memory somewhere, one host, or one rank per host
    n_hosts = max(hosts) + 1
    if pg.id >= 1 << (31 - _INDEX_BITS) or n_hosts >= 1 << _INDEX_BITS:
        if pg.id & HIDDEN:  # (a hidden sub-group spanning hosts: chorus.cuda.nccl's agreement)
            return None
        log.info("chorus: group %d (%d hosts) runs flat over TCP: too many groups or hosts for "
                 "hierarchical sub-group ids", pg.id, n_hosts)
        return None
    by_host = tuple(tuple(r for r, h in enumerate(hosts) if h == host) for host in range(n_hosts))
    host = hosts[pg.rank()]
    local = hidden_subgroup(pg, 1 + host, by_host[host], f"{pg.name}/host{host}")
    local.phase_of = pg
    attach(local, settings=False)  # CHORUS_ALGO_* picks the parent's path, not this one's
    leaders = None
    if by_host[host][0] == pg.rank():
        leaders = hidden_subgroup(pg, 0, tuple(ranks[0] for ranks in by_host), f"{pg.name}/leaders")
        leaders.phase_of = pg
        _over_tcp(leaders)  # one rank per host: TCP only
    columns = column_ids(pg, by_host)
    return Hierarchy(pg, hosts, by_host, local, leaders, column(pg, by_host, host, leaders) if columns else None,
                     columns)


def column_ids(pg: ProcessGroup, by_host: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """The ids of the columns after the first (whose ranks are the leaders, and which is the
    leaders' group: so ranks that disagree on the path still meet, and see the mismatch),
    registered with the transport on every member so that any member can mark them all
    broken; none where hosts differ in size.  Ids after the rails' (chorus.cuda.rails:
    1 + hosts + place), so that the two never share one."""
    widest = len(by_host[0])
    if any(len(ranks) != widest for ranks in by_host) or 1 + len(by_host) + 2 * widest >= (1 << _INDEX_BITS) - 1:
        return ()
    ids = tuple(HIDDEN | pg.id << _INDEX_BITS | (1 + len(by_host) + widest + place) for place in range(1, widest))
    for gid in ids:
        pg.transport.register_group(gid, pg.members)
    return ids


def column(pg: ProcessGroup, by_host: tuple[tuple[int, ...], ...], host: int,
           leaders: ProcessGroup | None) -> ProcessGroup | None:
    """This rank's column: the ranks at its place on every host (rank i of each host), with
    a TCP lane (where column_ids has ids: hosts of one size)."""
    widest = len(by_host[0])
    place = by_host[host].index(pg.rank())
    if place == 0:
        return leaders
    sub = hidden_subgroup(pg, 1 + len(by_host) + widest + place, tuple(ranks[place] for ranks in by_host),
                          f"{pg.name}/column{place}")
    sub.phase_of = pg
    _over_tcp(sub)
    return sub


def _over_tcp(sub: ProcessGroup) -> None:
    """Give a sub-group of one rank per host its components: TCP schedules and their lane."""
    schedules = ScheduleComponent()
    sub.components = (schedules,)
    sub.lane = TcpLane(sub, schedules)


def hidden_subgroup(pg: ProcessGroup, index: int, ranks: tuple[int, ...], name: str) -> ProcessGroup:
    """A sub-group of ``pg``'s group ranks ``ranks`` whose ops fail when any member of ``pg``
    dies, with id ``HIDDEN | pg.id << 12 | index`` (index 0: the leaders, 1 + h: host h;
    chorus.cuda.rails numbers its rails after those)."""
    me = pg.members[pg.rank()]
    sub = ProcessGroup(HIDDEN | pg.id << _INDEX_BITS | index, tuple(pg.members[r] for r in ranks), me,
                       pg.transport, pg.timeout, name=name, backend=pg.backend)
    pg.transport.register_group(sub.id, pg.members)  # failure scope: the whole parent
    return sub


class Hierarchy(Component):
    """A group's hosts and hidden sub-groups; runs its hierarchical collectives."""

    name = "hierarchical"

    def __init__(self, pg: ProcessGroup, hosts: tuple[int, ...], by_host: tuple[tuple[int, ...], ...],
                 local: ProcessGroup, leaders: ProcessGroup | None, column: ProcessGroup | None = None,
                 column_ids: tuple[int, ...] = ()):
        self.pg = pg
        self.hosts = hosts  # group rank -> host
        self.by_host = by_host  # host -> its group ranks, leader first
        self.host = hosts[pg.rank()]
        self.local = local  # this rank's host
        self.leaders = leaders  # None unless this rank leads its host
        self.column = column  # the ranks at this rank's place on every host (None: hosts differ in size)
        self.column_ids = column_ids  # every column's id but the leaders'
        self.widest = max(len(ranks) for ranks in by_host)
        order = tuple(r for ranks in by_host for r in ranks)
        self.order = None if order == tuple(range(len(hosts))) else order  # host order, if not 0..W-1
        slots = [self.widest * hosts[r] + by_host[hosts[r]].index(r) for r in range(len(hosts))]
        plain = slots == list(range(len(hosts))) and len(hosts) == self.widest * len(by_host)
        self.slots = None if plain else np.array(slots)  # all_gather's block of each rank
        forced = forced_algorithms()
        self.default = frozenset(name for name in OPS if forced.get(name, HIERARCHICAL) == HIERARCHICAL)
        self.schedules = ScheduleComponent()  # the group's flat algorithms (chorus.components.select)
        # an all_reduce from this many bytes runs the ring through the hosts (module docstring)
        ring = self.order is None and self.widest <= RING_HOST_RANKS
        self.ring_from = config.get("CHORUS_HIER_RING_BYTES") if ring else 0
        # ... and, large enough, in parts on the job's channels (only that ring: a flat
        # algorithm forced on the group runs unsplit, as it did)
        self.ring_parts = (ScheduleComponent(channels=GroupChannels(pg, pg.channels))
                           if self.ring_from and pg.channels is not None else None)
        self.current = -1  # the group's op this rank runs (or ran last), by sequence number
        pg.transport.add_failure_listener(self._on_failure)

    def __repr__(self) -> str:
        hosts = [[self.pg.members[r] for r in ranks] for ranks in self.by_host]
        return f"Hierarchy(group={self.pg.id}, hosts={hosts})"

    def supports(self, call: Call) -> str | None:
        """Collectives of OPS, unless the call or the group's settings name a flat algorithm;
        ``ring`` for an all_reduce of at least ``ring_from`` bytes (module docstring)."""
        if call.algorithm is None:
            if call.name not in self.default:
                return None
            return RING if call.name == "all_reduce" and 0 < self.ring_from <= call.nbytes else HIERARCHICAL
        return HIERARCHICAL if call.algorithm == HIERARCHICAL and call.name in OPS else None

    def start(self, call: Call, algorithm: str) -> Work | None:
        pg = self.pg
        if algorithm == RING:
            return self._ring(call)

        def transfers(ctx) -> None:
            self._phases(ctx, OPS[call.name], Phases(self, call, ctx))
            pg.transport.finished(pg.id, ctx.seq, ctx.fingerprint)

        return run_in_order(call, self.name, algorithm, transfers, hosts=len(self.by_host))

    def _ring(self, call: Call) -> Work | None:
        """``call``, an all_reduce, as the flat ring on the group's transport, the hosts'
        ranks consecutive along it (in parts on the job's channels when large enough); a
        mismatch ends as a phase's does (``failed``)."""
        pg = self.pg
        data = call.buffers["data"]
        code = DTYPE_CODES[call.dtype]
        split = self.ring_parts
        parts = split.channels.parts(call.nbytes) if split is not None else 1
        schedule = None if parts > 1 else self.schedules.schedule(pg, "all_reduce", RING, call.args, -1,
                                                                  data.itemsize)

        def transfers(ctx) -> None:
            self.current = ctx.seq
            try:
                if schedule is None:  # part 0 on the group's transport (its hops inside a host
                    # over shared memory), part k on channel k's sockets, at once
                    split.in_parts(call, RING, ctx, parts, data.itemsize, code)
                else:
                    pg.run_schedule(schedule, call.buffers, ctx, code, call.combine, RING)
            except CollectiveMismatchError as exc:  # (a PeerLostError names this op already)
                raise self.failed(exc, ctx) from None

        detail = {"channels": parts} if parts > 1 else {}
        return run_in_order(call, self.name, RING, transfers, hosts=len(self.by_host), **detail)

    def begin(self, seq: int, fingerprint: int) -> None:
        """This rank starts op ``seq`` of the group in phases: no frame of it comes on the
        group itself (``Transport.elsewhere``: a rank running it as the ring is a mismatch);
        and if the group broke at this op or before, while this rank finished an earlier
        one (the failure listener then left the sub-groups alone), raise its mismatch now."""
        t = self.pg.transport
        self.current = seq
        t.elsewhere(self.pg.id, seq, fingerprint)
        error = t.failure(self.pg.id, None, expect=(seq, fingerprint))
        if isinstance(error, CollectiveMismatchError):
            raise error

    def _phases(self, ctx, algorithm: Callable[[Phases], None], c: Phases) -> None:
        try:
            self.begin(ctx.seq, ctx.fingerprint)
            algorithm(c)
        except (CollectiveMismatchError, PeerLostError) as exc:
            raise self.failed(exc, ctx) from None

    def failed(self, exc: CollectiveMismatchError | PeerLostError, ctx) -> Exception:
        """What op ``ctx`` of the group raises when a phase raised ``exc``: the group's
        mismatch (the user's calls, not the phases': this rank's goes to every member of
        the group, its sub-groups marked broken), or the peer lost, named with the op."""
        if isinstance(exc, PeerLostError):
            return PeerLostError(f"{ctx.describe()} (hierarchical), in {exc}", exc.lost_rank, exc.reporter)
        self._break(ctx.fingerprint)
        t = self.pg.transport
        t.group_mismatch(self.pg.id, t.rank, ctx.seq, ctx.fingerprint, t.rank)
        return t.mismatch_error(self.pg.id, (ctx.seq, ctx.fingerprint))

    def _break(self, fingerprint: int) -> None:
        """Mark this rank's sub-groups broken on every member, so that ranks waiting in
        another phase of this op raise instead of waiting for the timeout."""
        t = self.pg.transport
        for sub in (self.local, self.leaders):
            if sub is not None:
                t.group_mismatch(sub.id, t.rank, 0, fingerprint, t.rank)
        for gid in self.column_ids:  # every column: a rank of another place may wait in its own
            t.group_mismatch(gid, t.rank, 0, fingerprint, t.rank)

    def _on_failure(self, group: int, why: str) -> None:
        """The transport's failure listener: the group itself broke (a mismatch seen on it,
        such as a frame of an op this rank runs in phases): so do its sub-groups, where
        this rank or another may wait in a phase of that op; not while this rank still
        finishes an earlier op (the group's next op raises at ``begin``)."""
        at = self.pg.transport.mismatched_at.get(group)
        if group == self.pg.id and at is not None and self.current >= at:
            self._break(0)

    def close(self) -> None:
        """Release the host-local sub-group's components and the ring's channel threads (the
        parent group is being destroyed)."""
        self.pg.transport.remove_failure_listener(self._on_failure)
        if self.ring_parts is not None:
            self.ring_parts.close()
        for component in self.local.components:
            component.close()


class Phases:
    """One hierarchical op on this rank: its buffers, and a phase runner for the sub-groups."""

    def __init__(self, h: Hierarchy, call: Call, ctx):
        self.h, self.call, self.ctx = h, call, ctx
        self.buffers, self.root, self.args = call.buffers, call.root, call.args
        self.me = h.pg.rank()
        self.local, self.leaders = h.local, h.leaders
        self.leader = h.leaders is not None

    def phase(self, group: ProcessGroup, name: str, buffers: dict[str, np.ndarray], args: dict, *,
              root: int = -1, reduce: bool = False, count: int | None = None, uniform: bool = True) -> None:
        """Run collective ``name`` on sub-group ``group`` now, with the op's dtype (and its
        reduction when ``reduce``); ``count`` (default ``args["count"]``) is fingerprinted."""
        from chorus.components.select import start  # select imports this module

        sub = self.call.on(group, name, buffers, args, root=root, reduce=reduce, count=count, uniform=uniform)
        began = time.perf_counter() if recorder.current is not None else 0.0
        start(sub)
        if began:
            recorder.transfer("phase", self.ctx, "hierarchical", began, sub.nbytes, algorithm=HIERARCHICAL,
                              group=group.name, collective=name)


def all_reduce(c: Phases) -> None:
    """Hosts a, a, b, b, b; every rank r holds x_r; every rank ends with S = x0 + ... + x4::

        rank (host)          0 (a)    1 (a)    2 (b)       3 (b)    4 (b)
        1 reduce in host     x0+x1             x2+x3+x4                      shared memory
        2 all_reduce         S                 S                             TCP, leaders
        3 broadcast in host  S        S        S           S        S        shared memory

    Up to COLUMN_BYTES, where every host has as many ranks, two phases instead: an
    all_reduce in each host (every rank gets its host's sum), then one among the ranks at
    the same place on every host (its column); every column sums the same host sums in
    the same order, so every rank gets the same bits::

        hosts a, a, b, b     rank 0 (a)   1 (a)    2 (b)    3 (b)
        1 all_reduce in host     x0+x1    x0+x1    x2+x3    x2+x3     shared memory
        2 all_reduce, column     S        S        S        S         TCP: (0, 2), (1, 3)

    Larger ones there, of a count the host's size divides, share the hosts' traffic among
    the columns: each rank's column reduces one block of the host's sums (S_i: block i of S)::

        1 reduce_scatter in host   block 0 of x0+x1   block 1 of x0+x1   ...      shared memory
        2 all_reduce, column       S_0                S_1                S_0 S_1  TCP
        3 all_gather in host       S                  S                  S   S    shared memory
    """
    data = c.buffers["data"]
    n = {"count": data.size}
    if c.h.column is not None and data.nbytes <= COLUMN_BYTES:
        c.phase(c.local, "all_reduce", {"data": data}, n, reduce=True)
        c.phase(c.h.column, "all_reduce", {"data": data}, n, reduce=True)
        return
    size = c.local.size()
    if c.h.column is not None and data.size % size == 0:
        k = data.size // size
        chunk = np.empty(k, data.dtype)
        c.phase(c.local, "reduce_scatter", {"input": data, "output": chunk}, {"counts": (k,) * size},
                count=data.size, reduce=True)
        c.phase(c.h.column, "all_reduce", {"data": chunk}, {"count": k}, reduce=True)
        c.phase(c.local, "all_gather", {"input": chunk, "output": data}, {"count": k})
        return
    c.phase(c.local, "reduce", {"data": data}, n, root=0, reduce=True)
    if c.leader:
        c.phase(c.leaders, "all_reduce", {"data": data}, n, reduce=True)
    c.phase(c.local, "broadcast", {"data": data}, n, root=0)


def reduce(c: Phases) -> None:
    """Hosts a, a, b, b; dst 3; the other ranks keep their input (leaders reduce in a copy)::

        rank (host)                     0 (a)    1 (a)    2 (b)    3 (b)
        1 reduce in host                x0+x1             x2+x3             shared memory
        2 reduce to dst's host leader                     S                 TCP, leaders
        3 broadcast in dst's host                                  S        only if dst leads no host
    """
    data, h = c.buffers["data"], c.h
    n, host = {"count": data.size}, h.hosts[c.root]
    acc = data.copy() if c.leader and c.me != c.root else data
    c.phase(c.local, "reduce", {"data": acc}, n, root=0, reduce=True)
    if c.leader:
        c.phase(c.leaders, "reduce", {"data": acc}, n, root=host, reduce=True)
    if h.host == host and h.by_host[host][0] != c.root:
        sink = acc if c.leader else data if c.me == c.root else np.empty_like(data)
        c.phase(c.local, "broadcast", {"data": sink}, n, root=0)


def broadcast(c: Phases) -> None:
    """Hosts a, a, b, b; src 3 holds x; every rank ends with x::

        rank (host)                            0 (a)   1 (a)   2 (b)   3 (b)
        1 broadcast in src's host from src                     x       x    if src leads no host
        2 broadcast from src's host leader     x               x            TCP, leaders
        3 broadcast in host from the leader    x       x                    hosts phase 1 did not serve
    """
    data, h = c.buffers["data"], c.h
    n, host = {"count": data.size}, h.hosts[c.root]
    inner = h.by_host[host].index(c.root)  # src's rank in its host
    if h.host == host and inner != 0:
        c.phase(c.local, "broadcast", {"data": data}, n, root=inner)
    if c.leader:
        c.phase(c.leaders, "broadcast", {"data": data}, n, root=host)
    if h.host != host or inner == 0:
        c.phase(c.local, "broadcast", {"data": data}, n, root=0)


def all_gather(c: Phases) -> None:
    """Hosts a, b, a (uneven, interleaved); rank r holds x_r; every rank ends with [x0 x1 x2]::

        rank (host)                         0 (a)            1 (b)     2 (a)
        1 gather in host to the leader      [x0 x2]          [x1 __]             padded to the widest host
        2 all_gather among leaders          [x0 x2 x1 __]    same                TCP, leaders
        3 leader reorders; broadcast        [x0 x1 x2]       [x0 x1 x2]  [x0 x1 x2]
    """
    src, out, h = c.buffers["input"], c.buffers["output"], c.h
    n, buffers = src.size, {"input": src}
    if c.leader:  # the host's blocks, padded to the widest host
        mine = np.zeros(h.widest * n, src.dtype)
        buffers["output"] = mine[:c.local.size() * n]
    c.phase(c.local, "gather", buffers, {"count": n}, root=0)
    if c.leader:
        every = out if h.slots is None else np.empty(len(h.by_host) * h.widest * n, src.dtype)
        c.phase(c.leaders, "all_gather", {"input": mine, "output": every}, {"count": h.widest * n})
        if h.slots is not None:
            out.reshape(len(h.hosts), n)[...] = every.reshape(len(h.by_host) * h.widest, n)[h.slots]
    c.phase(c.local, "broadcast", {"data": out}, {"count": out.size}, root=0)


def reduce_scatter(c: Phases) -> None:
    """Hosts a, b, b; ranks hold [A0 A1 A2], [B0 B1 B2], [C0 C1 C2] (blocks may differ in size);
    rank r ends with block r reduced over all ranks::

        rank (host)                        0 (a)         1 (b)                   2 (b)
        1 reduce in host to the leader     A             B+C                              shared memory
        2 reduce_scatter of host blocks    A0+B0+C0      [A1+B1+C1, A2+B2+C2]             TCP, leaders
        3 scatter in host (all_to_all)     A0+B0+C0      A1+B1+C1                A2+B2+C2 shared memory

    The host blocks are the members' blocks in host order (reordered when hosts interleave).
    """
    src, out, h = c.buffers["input"], c.buffers["output"], c.h
    counts, mine = c.args["counts"], h.by_host[h.host]
    acc = src.copy() if c.leader else src
    c.phase(c.local, "reduce", {"data": acc}, {"count": src.size}, root=0, reduce=True)
    block = np.empty(sum(counts[r] for r in mine) if c.leader else 0, src.dtype)
    if c.leader:
        per_host = tuple(sum(counts[r] for r in ranks) for ranks in h.by_host)
        c.phase(c.leaders, "reduce_scatter", {"input": _host_order(acc, counts, h.order), "output": block},
                {"counts": per_host}, count=src.size, reduce=True, uniform=len(set(per_host)) == 1)
    sends = tuple(counts[r] for r in mine) if c.leader else (0,) * len(mine)
    receives = (counts[c.me],) + (0,) * (len(mine) - 1)
    c.phase(c.local, "all_to_all", {"input": block, "output": out},
            {"send_counts": sends, "recv_counts": receives}, uniform=False)


def _host_order(flat: np.ndarray, counts: tuple[int, ...], order: tuple[int, ...] | None) -> np.ndarray:
    """``flat`` (block r for group rank r, ``counts[r]`` long) with its blocks in ``order``."""
    if order is None:
        return flat
    starts = np.concatenate(([0], np.cumsum(counts)))
    return np.concatenate([flat[starts[r]:starts[r + 1]] for r in order])


def barrier(c: Phases) -> None:
    """Every rank of a host arrives (shared memory); the leaders meet (TCP); each leader
    releases its host (shared memory).  No rank leaves before every rank has arrived."""
    token = {"token": c.buffers["token"]}
    c.phase(c.local, "barrier", token, {})
    if c.leader:
        c.phase(c.leaders, "barrier", token, {})
    c.phase(c.local, "barrier", token, {})


OPS: dict[str, Callable[[Phases], None]] = {
    "all_reduce": all_reduce, "reduce": reduce, "broadcast": broadcast, "all_gather": all_gather,
    "reduce_scatter": reduce_scatter, "barrier": barrier,
}
