"""``RailsComponent``: CUDA tensors of a group that spans hosts with as many GPUs on each:
chorus's CUDA component inside each host, one communicator per rail between hosts.

    hosts a, a, b, b (group ranks 0..3); a rank's index is its place on its host

    local   host a: [0, 1]   host b: [2, 3]   chorus.cuda over NVLink (the hierarchy's
                                               host sub-group, chorus.components.hierarchy);
                                               from CHORUS_CUDA_NCCL_GATHER_FROM_BYTES, the
                                               all_reduce's phases on a host NCCL
                                               communicator (NCCL rails only)
    rails   rail 0: [0, 2]   rail 1: [1, 3]   NCCL: torch's ProcessGroupNCCL on the rail's
                                               ranks; or a chorus sub-group whose CUDA
                                               tensors are staged through pinned host
                                               memory over TCP (CHORUS_CUDA_RAILS=tcp)

Why torch's ProcessGroupNCCL for a rail, not another binding: the GPU extra already
requires torch with CUDA, which ships NCCL and its network plugins; a rail communicator is
one ProcessGroupNCCL (chorus.cuda.nccl.NcclPeers: over a torch TCPStore that the rail's
first member serves), with no package beside torch.  Its ops are queued on the caller's
current stream (chorus.cuda.nccl.on_current_stream), so the three phases below queue on
the GPU, in order, without the CPU waiting for any of them.

all_reduce, with L ranks a host and n elements (padded to a multiple of L in a scratch
buffer when L does not divide n)::

    rank (host, index)     0 (a, 0)    1 (a, 1)    2 (b, 0)    3 (b, 1)
    1 reduce_scatter       A0          A1          B0          B1          in host: shard i of
                                                                           the host's sum
    2 all_reduce on rail   A0+B0       A1+B1       A0+B0       A1+B1       rail i: shard i of
                                                                           the group's sum
    3 all_gather           S           S           S           S           in host

broadcast from group rank r0 (host h0, index i0): rail i0 broadcasts from host h0, then
every host broadcasts from its rank of index i0.  Reductions NCCL cannot run as chorus
does (bitwise ops; dtypes outside chorus.cuda.nccl.NCCL_REDUCE_DTYPES), collectives the
whole group's communicator below does not take (gather, scatter, reduce, uneven
reduce_scatter, barrier), point-to-point, and groups whose hosts hold different numbers of
ranks are staged (chorus.cuda.staging).

The whole group's NCCL communicator.  With NCCL rails, all_reduce runs as one NCCL
all_reduce over the whole group (CHORUS_CUDA_RAILS_ALL_REDUCE "flat", the default; "rails"
runs the three phases above, and ``algorithm="rails"`` or ``"nccl"`` picks either for one
call), and so do all_gather and reduce_scatter of equal blocks and all_to_all, which
would otherwise be staged through host memory.  The phases run one after another, so a
message spends the in-host phases' NVLink time on top of the rail's: on two simulated
hosts of 2 H200s the flat all_reduce took 0.58-0.80x the phases' time at every size from
64 KiB to 1 GiB (docs/results/4xh200/rails-flat/), and torch's own three NCCL calls in
sequence reach no more than chorus's phases (0.61-0.79x flat's speed from 16 MiB, slower
still pipelined: tools/rails_bound.py, docs/results/4xh200/speed-run-3/rails-bound.txt).
NCCL's flat all_reduce keeps the links inside and between hosts busy at once, and
chorus.sim's model of large clusters gives the sequential hierarchy no win either
(docs/scale.md).  The default is flat at every size; the sizes measured were 64 KiB to
1 GiB.

Results: every rank gets the same bits, NCCL's on the flat communicator; through the
phases each element is reduced once per host in rank order by chorus's kernels, then by
NCCL on its rail, and copied (with rounding, another order than a flat all_reduce's).

Before anything is queued, the members compare the op's fingerprint over chorus's own CPU
path: with NCCL, all of the group's members at once (the whole group's hidden sub-group,
chorus.cuda.nccl.NcclPeers.agree), so that every rank reaches the same verdict, also
before the flat communicator exists (a rank passing a narrower check would go on to make
it and wait there for ranks that raised); over TCP rails, the rail's members (the host's
phases then compare on the GPUs).  Ranks that called different collectives raise
CollectiveMismatchError naming both calls, instead of handing NCCL mismatched ops.  As
with the hand-off inside a host, an all_to_all's splits are not compared: splits that
disagree reach NCCL.  A lost rank fails the group as everywhere in chorus (the
sub-groups share the parent's failure scope); the NCCL communicators are aborted at once,
so no NCCL kernel waits for a dead peer.
"""

from __future__ import annotations

import logging

from chorus import config
from chorus.components import select
from chorus.components.base import Component, run_in_order
from chorus.components.hierarchy import hidden_subgroup
from chorus.cuda import staging
from chorus.cuda.nccl import NcclPeers, address_key, group_peers, nccl_available, nccl_reduces

log = logging.getLogger("chorus")

#: what the rails run; every other call is staged
RAIL_OPS = frozenset({"all_reduce", "broadcast"})
#: what the whole group's NCCL communicator runs (all_gather and reduce_scatter of equal blocks)
FLAT_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "all_to_all"})


def rails_of(by_host: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...] | None:
    """Rail i = the i-th group rank of every host (host order), or None when the hosts
    hold different numbers of ranks (no rails: such a group stages).

    >>> rails_of(((0, 1), (2, 3)))
    ((0, 2), (1, 3))
    >>> rails_of(((0, 1, 2), (3,))) is None
    True
    """
    if len({len(ranks) for ranks in by_host}) != 1:
        return None
    return tuple(tuple(ranks[i] for ranks in by_host) for i in range(len(by_host[0])))


def shard(n: int, local: int) -> int:
    """Elements of each rank's shard when ``n`` elements are split over ``local`` ranks
    (the last shards padded).

    >>> shard(10, 4), shard(8, 4), shard(0, 4)
    (3, 2, 0)
    """
    return -(-n // local)


def rails_kind() -> str:
    """CHORUS_CUDA_RAILS, with "auto" resolved: "nccl" where torch has NCCL, else "tcp"."""
    kind = config.get("CHORUS_CUDA_RAILS")
    if kind != "auto":
        return kind
    return "nccl" if nccl_available() else "tcp"


def attach(pg, why: str):
    """``pg``'s RailsComponent, or None (the caller stages every call, logging ``why``):
    for a group with a hierarchy (several hosts, several ranks on some), hosts of equal
    size and CHORUS_CUDA_RAILS not "off".  Collective: every member calls it."""
    h = getattr(pg, "hierarchy", None)
    kind = rails_kind()
    if h is None or kind == "off":
        return None
    rails = rails_of(h.by_host)
    if rails is None:
        log.info("chorus: group %s stages CUDA tensors (%s); no rails: its hosts hold %s ranks", pg.name, why,
                 sorted({len(r) for r in h.by_host}))
        return None
    return RailsComponent(pg, h, rails, kind, why)


class RailsComponent(Component):
    """Group ``pg``'s CUDA component across hosts: ``hierarchy``'s host sub-group inside
    the host, ``rails`` (group ranks per rail) of ``kind`` "nccl" or "tcp" between hosts."""

    name = "cuda-rails"

    def __init__(self, pg, hierarchy, rails, kind: str, why: str = ""):
        self.pg = pg
        self.hierarchy = hierarchy
        self.kind = kind
        self.staging_reason = why  # what the group's staged calls log and report
        self.lanes = None  # (no workspace of its own: the host sub-group's component has one)
        me = pg.rank()
        self.local = hierarchy.local
        self.index = hierarchy.by_host[hierarchy.host].index(me)
        self.rail_ranks = rails[self.index]
        self.rail_rank = self.rail_ranks.index(me)
        index = 1 + len(hierarchy.by_host) + self.index  # after the leaders' and the hosts' sub-groups
        self.rail = hidden_subgroup(pg, index, self.rail_ranks, f"{pg.name}/rail{self.index}")
        select.attach(self.rail, settings=False)
        # the rail's NCCL communicator (made at its first op), fingerprints agreed on the rail;
        # each communicator's store key counts the ones its members made before
        # (chorus.cuda.nccl.address_key): a rail attached again reads no stale address
        self.peers = NcclPeers(pg, self.rail_ranks, self.rail,
                               address_key(f"chorus/rails/{pg.id}/{self.index}", len(self.rail_ranks)),
                               (pg, self.local))
        # the host's phases of large all_reduces on NCCL too (chorus's hidden host sub-group
        # never hands off itself: chorus.cuda.nccl.nccl_handoff), from the size where a
        # flat group hands its all_gathers and reduce_scatters to NCCL
        self.host_from = config.get("CHORUS_CUDA_NCCL_GATHER_FROM_BYTES") if kind == "nccl" else 0
        self.host_peers = NcclPeers(pg, hierarchy.by_host[hierarchy.host], self.local,
                                    address_key(f"chorus/rails/{pg.id}/host{hierarchy.host}",
                                                len(hierarchy.by_host[hierarchy.host])),
                                    (pg, self.local)) if self.host_from else None
        # one NCCL communicator over the whole group (made at its first op): all_reduce
        # (CHORUS_CUDA_RAILS_ALL_REDUCE), all_gather, reduce_scatter and all_to_all; its
        # members' agreement is every op's with NCCL rails
        self.flat = group_peers(pg) if kind == "nccl" else None
        self.flat_all_reduce = config.get("CHORUS_CUDA_RAILS_ALL_REDUCE") == "flat"
        from chorus.cuda.component import CudaComponent

        self.staged = CudaComponent(pg, None, why)  # what runs every call the rails do not

    def __repr__(self) -> str:
        return f"RailsComponent(group={self.pg.id}, rail={[self.pg.members[r] for r in self.rail_ranks]}, {self.kind})"

    # -- Component ---------------------------------------------------------------------------------
    def supports(self, call) -> str | None:
        """"nccl": on the whole group's NCCL communicator; "rails": the phases above;
        "staging": through host memory (chorus.cuda.staging).  Every input to the choice
        is in the op's fingerprint, or a setting, or ``algorithm=``, the same on every rank."""
        first = next(iter(call.buffers.values()), None)
        if first is None or (call.reduce_op and not nccl_reduces(staging.torch_dtype_name(first), call.reduce_op)):
            return "staging"
        if self.flat is not None and call.name in FLAT_OPS:
            if call.name == "all_reduce" and call.algorithm in (None, "nccl", "rails"):
                return call.algorithm or ("nccl" if self.flat_all_reduce else "rails")
            if call.algorithm in (None, "nccl") and (call.uniform or call.name == "all_to_all"):
                return "nccl"  # (all_to_all at every split: whether a rank's own are equal differs by rank)
        return "rails" if call.name in RAIL_OPS and call.algorithm in (None, "rails") else "staging"

    def start(self, call, algorithm: str):
        if algorithm == "staging":
            return self.staged.start(call, algorithm)
        import torch

        self.check(call.name)
        stream = torch.cuda.current_stream()
        sync = call._replace(async_op=False, before=staging.on_stream(call.before, stream),
                             after=staging.on_stream(call.after, stream))

        def transfers(ctx) -> None:
            (self.flat or self.peers).agree(call)  # (the whole group's members, with NCCL rails)
            if algorithm == "nccl":
                self.flat.run(call)
            elif call.name == "all_reduce":
                self._all_reduce(call)
            else:
                self._broadcast(call)
            self.pg.transport.finished(self.pg.id, ctx.seq)

        run_in_order(sync, self.name, algorithm, staging.on_stream(transfers, stream), hosts=len(self.rail_ranks))
        if not call.async_op:
            return None
        from chorus.cuda.work import CudaWork

        return CudaWork(stream.record_event(), lambda: self.check(call.name), call.result,
                        tuple(call.buffers.values()))

    def all_reduce_now(self, tensor, op, async_op: bool = False) -> bool:
        """The API's latency lane (CudaComponent.all_reduce_now's signature): never here
        (the general path runs the rails)."""
        return False

    def rows_now(self, name: str, output, input, op, async_op: bool = False) -> bool:
        """CudaComponent.rows_now's signature: never here either."""
        return False

    def p2p(self, kind: str, tensor, peer: int, tag: int, async_op: bool):
        return self.staged.p2p(kind, tensor, peer, tag, async_op)

    def p2p_batch(self, ops, async_op: bool):
        """Point-to-point across hosts: staged through pinned host memory."""
        return self.staged.p2p_batch(ops, async_op)

    def check(self, what: str) -> None:
        """Raise the group's error, if it has one."""
        for peers in (self.peers, self.host_peers, self.flat):
            if peers is not None:
                peers.check()

    def close(self) -> None:
        """Abort the rails' NCCL communicators; release the rail sub-group's components
        and the host sub-group's CUDA one (its workspace; the hierarchy releases the
        host sub-group's others)."""
        for peers in (self.peers, self.host_peers, self.flat):
            if peers is not None:
                peers.close()
        for component in (*self.rail.components, *self.rail.device_components.values(),
                          *self.local.device_components.values()):
            component.close()
        self.rail.device_components.clear()
        self.local.device_components.clear()

    # -- the phases ----------------------------------------------------------------------------------
    def _all_reduce(self, call) -> None:
        import torch

        data = call.buffers["data"]
        n, local = data.numel(), self.local.size()
        piece = shard(n, local)
        buf = data if piece * local == n else torch.empty(piece * local, dtype=data.dtype, device=data.device)
        if buf is not data:
            buf[:n].copy_(data)  # (the padding's values are reduced among themselves and dropped)
        mine = torch.empty(piece, dtype=data.dtype, device=data.device)
        large = self.host_from and buf.numel() * buf.element_size() >= self.host_from
        host = self.host_peers if large else None
        if host is not None:  # (every input to the choice is the same on every rank of the call)
            host.reduce_scatter(mine, buf, call.reduce_op)
        else:
            select.start(call.on(self.local, "reduce_scatter", {"input": buf, "output": mine},
                                 {"counts": (piece,) * local}, reduce=True, count=piece))
        if self.kind == "nccl":
            self.peers.all_reduce(mine, call.reduce_op)
        else:
            select.start(call.on(self.rail, "all_reduce", {"data": mine}, {"count": piece}, reduce=True,
                                 count=piece))
        if host is not None:
            host.all_gather(buf, mine)
        else:
            select.start(call.on(self.local, "all_gather", {"input": mine, "output": buf}, {"count": piece},
                                 count=piece))
        if buf is not data:
            data.copy_(buf[:n])

    def _broadcast(self, call) -> None:
        data = call.buffers["data"]
        by_host = self.hierarchy.by_host
        root_host = self.hierarchy.hosts[call.root]
        root_index = by_host[root_host].index(call.root)
        n = data.numel()
        if self.index == root_index:
            if self.kind == "nccl":
                self.peers.broadcast(data, root_host)
            else:
                select.start(call.on(self.rail, "broadcast", {"data": data}, {"count": n}, root=root_host,
                                     count=n))
        select.start(call.on(self.local, "broadcast", {"data": data}, {"count": n}, root=root_index, count=n))
