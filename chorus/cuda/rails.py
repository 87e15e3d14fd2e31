"""``RailsComponent``: CUDA tensors of a group that spans hosts with as many GPUs on each:
chorus's CUDA component inside each host, one communicator per rail between hosts.

    hosts a, a, b, b (group ranks 0..3); a rank's index is its place on its host

    local   host a: [0, 1]   host b: [2, 3]   chorus.cuda over NVLink (the hierarchy's
                                               host sub-group, chorus.components.hierarchy)
    rails   rail 0: [0, 2]   rail 1: [1, 3]   NCCL: torch's ProcessGroupNCCL on the rail's
                                               ranks; or a chorus sub-group whose CUDA
                                               tensors are staged through pinned host
                                               memory over TCP (CHORUS_CUDA_RAILS=tcp)

Why torch's ProcessGroupNCCL for a rail, not another binding: the GPU extra already
requires torch with CUDA, which ships NCCL and its network plugins; a rail communicator is
one ProcessGroupNCCL (over a torch TCPStore that the rail's first member serves, its
address passed through chorus's store: rail_store), with no package beside torch.  Its ops run on NCCL's stream, ordered
after the caller's current stream; ``wait()`` makes the current stream wait for them, so
the three phases below queue on the GPU without the CPU waiting for any of them.

all_reduce, with L ranks a host and n elements (padded to a multiple of L in a scratch
buffer when L does not divide n)::

    rank (host, index)     0 (a, 0)    1 (a, 1)    2 (b, 0)    3 (b, 1)
    1 reduce_scatter       A0          A1          B0          B1          in host: shard i of
                                                                           the host's sum
    2 all_reduce on rail   A0+B0       A1+B1       A0+B0       A1+B1       rail i: shard i of
                                                                           the group's sum
    3 all_gather           S           S           S           S           in host

broadcast from group rank r0 (host h0, index i0): rail i0 broadcasts from host h0, then
every host broadcasts from its rank of index i0.  Every other collective, reductions the
rails cannot run (bitwise ops, bool and float8) and groups whose hosts hold different
numbers of ranks are staged as before (chorus.cuda.staging).

Results: every rank gets the same bits (each element is reduced once per host in rank
order by chorus's kernels, then by NCCL on its rail, and copied).  With rounding they can
differ from a flat NCCL all_reduce's, whose order is another.

Before anything is queued on a rail, its members compare the op's fingerprint over
chorus's own TCP path (one small all_gather on the rail's chorus sub-group): ranks that
called different collectives raise CollectiveMismatchError naming both calls, instead of
handing NCCL mismatched ops.  A lost rank fails the group as everywhere in chorus (the
sub-groups share the parent's failure scope); the rails' NCCL communicators are aborted
at once, so no NCCL kernel waits for a dead peer.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from chorus import config
from chorus.call import make
from chorus.components import select
from chorus.components.base import Component, run_in_order
from chorus.components.hierarchy import hidden_subgroup
from chorus.cuda import staging
from chorus.errors import CollectiveMismatchError
from chorus.wire.fingerprint import describe

log = logging.getLogger("chorus")

#: what the rails run; every other call is staged
RAIL_OPS = frozenset({"all_reduce", "broadcast"})
#: chorus's reduce op -> NCCL's, for the rail phase (AVG and PREMUL_SUM: the call's own
#: hooks scale before and divide after, the phases sum)
NCCL_OPS = {"SUM": "SUM", "AVG": "SUM", "PREMUL_SUM": "SUM", "PRODUCT": "PRODUCT", "MIN": "MIN", "MAX": "MAX"}
#: dtypes the rails leave to staging (NCCL's bool and float8 reductions are not chorus's)
STAGED_DTYPES = frozenset({"bool", "float8_e4m3fn", "float8_e5m2"})


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
    try:
        import torch.distributed as dist

        return "nccl" if dist.is_nccl_available() else "tcp"
    except ImportError:
        return "tcp"


def rail_store(key: str, chorus_store, first: bool, host: str, timeout_s: float):
    """The torch store a rail's ProcessGroupNCCL is made over: a torch ``TCPStore`` served
    by the rail's ``first`` member on a free port of ``host``, whose address the others
    read from ``chorus_store`` under ``key``.  A C++ store, not a torch view of chorus's
    store: ProcessGroupNCCL's own threads poll their store for as long as the group lives
    (its "should dump" flag, once a second), and through a Python store each poll would
    take the GIL from a C++ thread, on every rank, also while the interpreter shuts down."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if first:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        chorus_store.set(key, f"{host}:{store.port}")
        return store
    address = chorus_store.get(key)
    address = address.decode() if isinstance(address, bytes) else address
    peer, port = address.rsplit(":", 1)
    return dist.TCPStore(peer, int(port), is_master=False, timeout=timeout)


def rail_host(chorus_store, rank: int) -> str:
    """The address rank ``rank`` serves a rail's store on: the host of its TCP transport
    (``tcp/addr/<rank>``: what the other hosts already reach it at), else
    CHORUS_SOCKET_HOST, else loopback."""
    if chorus_store.check([f"tcp/addr/{rank}"]):
        address = chorus_store.get(f"tcp/addr/{rank}")
        return (address.decode() if isinstance(address, bytes) else address).rsplit(":", 1)[0]
    return config.get("CHORUS_SOCKET_HOST") or "127.0.0.1"


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
        self.nccl = None  # the rail's ProcessGroupNCCL, made at its first op
        self.nccl_store = None  # the torch store it is made over (rail_store)
        self.broken: BaseException | None = None
        from chorus.cuda.component import CudaComponent

        self.staged = CudaComponent(pg, None, why)  # what runs every call the rails do not
        pg.transport.add_failure_listener(self._on_failure)

    def __repr__(self) -> str:
        return f"RailsComponent(group={self.pg.id}, rail={[self.pg.members[r] for r in self.rail_ranks]}, {self.kind})"

    # -- Component ---------------------------------------------------------------------------------
    def supports(self, call) -> str | None:
        if call.name not in RAIL_OPS or call.algorithm not in (None, "rails"):
            return "staging"
        if call.reduce_op and call.reduce_op not in NCCL_OPS:
            return "staging"
        first = next(iter(call.buffers.values()), None)
        if first is None or staging.torch_dtype_name(first) in STAGED_DTYPES:
            return "staging"
        return "rails"

    def start(self, call, algorithm: str):
        if algorithm == "staging":
            return self.staged.start(call, algorithm)
        import torch

        if self.broken is not None:
            raise self.broken
        stream = torch.cuda.current_stream()
        sync = call._replace(async_op=False, before=staging.on_stream(call.before, stream),
                             after=staging.on_stream(call.after, stream))

        def transfers(ctx) -> None:
            self._agree(call)
            if call.name == "all_reduce":
                self._all_reduce(call)
            else:
                self._broadcast(call)
            self.pg.transport.finished(self.pg.id, ctx.seq)

        run_in_order(sync, self.name, algorithm, staging.on_stream(transfers, stream), hosts=len(self.rail_ranks))
        if not call.async_op:
            return None
        from chorus.cuda.work import CudaWork

        return CudaWork(stream.record_event(), self._check, call.result, tuple(call.buffers.values()))

    def all_reduce_now(self, tensor, op) -> bool:
        """The API's latency lane: never here (the general path runs the rails)."""
        return False

    def p2p(self, kind: str, tensor, peer: int, tag: int, async_op: bool):
        return self.staged.p2p(kind, tensor, peer, tag, async_op)

    def p2p_batch(self, ops, async_op: bool):
        """Point-to-point across hosts: staged through pinned host memory."""
        return self.staged.p2p_batch(ops, async_op)

    def check(self, what: str) -> None:
        """Raise the group's error, if it has one."""
        self._check()

    def close(self) -> None:
        """Abort the rails' NCCL communicators; release the rail sub-group's components
        and the host sub-group's CUDA one (its workspace; the hierarchy releases the
        host sub-group's others)."""
        self.pg.transport.remove_failure_listener(self._on_failure)
        self._abort()
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
        select.start(call.on(self.local, "reduce_scatter", {"input": buf, "output": mine},
                             {"counts": (piece,) * local}, reduce=True, count=piece))
        if self.kind == "nccl":
            import torch.distributed as dist

            opts = dist.AllreduceOptions()
            opts.reduceOp = getattr(dist.ReduceOp, NCCL_OPS[call.reduce_op])
            self._nccl().allreduce([mine], opts).wait()
        else:
            select.start(call.on(self.rail, "all_reduce", {"data": mine}, {"count": piece}, reduce=True,
                                 count=piece))
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
                import torch.distributed as dist

                opts = dist.BroadcastOptions()
                opts.rootRank = root_host
                self._nccl().broadcast([data], opts).wait()
            else:
                select.start(call.on(self.rail, "broadcast", {"data": data}, {"count": n}, root=root_host,
                                     count=n))
        select.start(call.on(self.local, "broadcast", {"data": data}, {"count": n}, root=root_index, count=n))

    def _agree(self, call) -> None:
        """Compare the op's fingerprint with the rail's other members (chorus's TCP path),
        before anything is queued: CollectiveMismatchError naming both calls."""
        mine = np.array([call.fingerprint], dtype=np.uint64)
        got = np.empty(len(self.rail_ranks), dtype=np.uint64)
        select.start(make(self.rail, "all_gather", dtype="uint64", count=1, buffers={"input": mine, "output": got},
                          async_op=False, algorithm=None, nbytes=8, args={"count": 1}))
        if (got == mine[0]).all():
            return
        members = self.pg.members
        other = int(next(g for g in got if g != mine[0]))
        ours = [members[r] for r, g in zip(self.rail_ranks, got, strict=True) if g == mine[0]]
        theirs = [members[r] for r, g in zip(self.rail_ranks, got, strict=True) if g == other]
        self.broken = CollectiveMismatchError(
            f"{call.name} #{call.seq} on group {self.pg.name}: rank(s) {ours} called {describe(call.fingerprint)} "
            f"but rank(s) {theirs} called {describe(other)}; every rank of a group must call the same "
            "collectives in the same order")
        t = self.pg.transport
        for sub in (self.pg, self.local, self.rail):
            t.group_mismatch(sub.id, members[self.rail_ranks[list(got).index(other)]], call.seq, other, t.rank)
        raise self.broken

    # -- NCCL --------------------------------------------------------------------------------------------
    def _nccl(self):
        """The rail's ProcessGroupNCCL (made at the rail's first op: collective on the rail)."""
        if self.nccl is None:
            import torch.distributed as dist

            from chorus.api.state import current

            chorus_store = current().store
            me = self.pg.members[self.pg.rank()]
            self.nccl_store = rail_store(f"chorus/rails/{self.pg.id}/{self.index}/address", chorus_store,
                                         self.rail_rank == 0, rail_host(chorus_store, me), self.pg.timeout)
            self.nccl = dist.ProcessGroupNCCL(self.nccl_store, self.rail_rank, len(self.rail_ranks))
        return self.nccl

    def _abort(self) -> None:
        nccl, self.nccl = self.nccl, None
        if nccl is not None:
            stop = getattr(nccl, "abort", None) or getattr(nccl, "shutdown", None)
            if stop is not None:
                stop()

    def _on_failure(self, group: int, why: str) -> None:
        dead = self.pg.transport.dead
        if self.nccl is not None and (group in (self.pg.id, self.rail.id)
                                      or (group == -1 and any(m in dead for m in self.pg.members))):
            # NCCL's kernels stop waiting for the lost peer; on a thread of its own, since
            # a listener must not block and aborting a communicator can take a while
            threading.Thread(target=self._abort, name="chorus-rails-abort", daemon=True).start()

    def _check(self) -> None:
        if self.broken is not None:
            raise self.broken
        failure = self.pg.transport.failure(self.pg.id, None)
        if failure is not None:
            raise failure
