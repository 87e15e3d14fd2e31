"""``NcclPeers``: torch's ProcessGroupNCCL over some ranks of a chorus group, with chorus's
contracts around it.  chorus.cuda.rails runs its rails (between hosts) on one;
chorus.cuda.component hands a group's calls inside a host to one where NCCL's kernels are
faster than chorus's: all_reduce, all_gather and reduce_scatter from a size on
(nccl_from, CHORUS_CUDA_NCCL_GATHER_FROM_BYTES), all_to_all and broadcast at every size.

    group ranks [0, 2] of group g, on group rank 2:

    peers = NcclPeers(g, (0, 2), agree_on=sub)   # sub: a chorus sub-group of those ranks
    peers.agree(call)                            # every member called the same op, or
                                                 # CollectiveMismatchError on each of them
    peers.all_reduce(t, "SUM")                   # NCCL's kernel queued on the current
                                                 # stream (on_current_stream)

What chorus adds to NCCL:

* **mismatches before NCCL sees them:** ``agree`` compares the op's fingerprint with the
  other members' before anything is queued (chorus's CPU path on ``agree_on``: the max of
  the fingerprint and of its complement through the group's shared-memory lane where it
  has one, then, if they differ, an all_gather naming who called what); NCCL handed
  mismatched ops would hang or corrupt memory.  Inside a host, chorus.cuda.component
  compares them on the GPUs instead (a barrier of its workspace beside NCCL's kernel,
  chorus.cuda.beside; CHORUS_CUDA_NCCL_AGREE), and ``watch`` aborts the communicator
  when that barrier found ranks doing different ops.
* **failures in seconds:** a lost member fails the group as everywhere in chorus, and the
  communicator is aborted at once (from a thread of its own: a failure listener must not
  block), so no NCCL kernel waits for a dead peer; NCCL's own watchdog would wait minutes.
* **a store of its own:** the communicator is made over a torch ``TCPStore`` that the
  first member serves, its address passed through chorus's store (``torch_store``).  A
  C++ store, not a Python view of chorus's: ProcessGroupNCCL's threads poll their store
  (a "should dump" flag, once a second) for the group's whole life, and through a Python
  store every poll would take the GIL from a C++ thread, also while the interpreter
  shuts down.

The communicator is made at the first op (collective over the members, as every op).
"""

from __future__ import annotations

import threading

import numpy as np

from chorus import config
from chorus.call import make
from chorus.components import select
from chorus.components.hierarchy import HIDDEN, hidden_subgroup
from chorus.cuda.layout import two_shot_chunk
from chorus.errors import AbortedError, CollectiveMismatchError
from chorus.reductions import ReduceOp
from chorus.wire.fingerprint import describe

#: chorus's reduce op -> NCCL's (AVG and PREMUL_SUM: the call's own hooks scale before and
#: divide after, NCCL sums)
NCCL_OPS = {"SUM": "SUM", "AVG": "SUM", "PREMUL_SUM": "SUM", "PRODUCT": "PRODUCT", "MIN": "MIN", "MAX": "MAX"}
#: how long closing waits for an abort already running on a listener's thread (NCCL's
#: abort of a communicator whose kernel waits for a killed peer took over 30 s on 4 H200s)
ABORT_WAIT_S = 5.0
#: how often watch() looks at its word (torch's NCCL watchdog looks every 100 ms)
WATCH_S = 0.05
#: the dtypes NCCL reduces as chorus does.  torch hands bool and float8 to NCCL as uint8,
#: whose sums are not chorus's; int16, uint16, uint32, uint64 and complex it cannot hand
#: NCCL at all.  Ops that only move data (all_gather, all_to_all, broadcast) take any
#: dtype: NCCL gets their bytes.
NCCL_REDUCE_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64"})


def on_current_stream(opts):
    """torch's options ``opts`` for an op the caller's stream waits for: ProcessGroupNCCL
    queues it on the current stream itself (``asyncOp`` off, as torch's own synchronous
    calls set it), instead of on its own stream with an event to wait for each way.  An
    async all_reduce (DDP's buckets) still runs on NCCL's stream; NCCL itself orders one
    communicator's launches whatever streams they come on (each waits for the last on the
    communicator's own device stream), so a synchronous op after it cannot overtake it.
    chorus's synchronous hand-offs ran at 0.98-0.99x torch's all_reduce at 16 MiB on 4
    H200s with the option left on, with or without the agreement's barrier beside them
    (docs/results/4xh200/speed-run-8/default-shapes/, handoff-agree/).  A torch without
    the option: as it is."""
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = False
    return opts


def waited(work) -> None:
    """The current stream waits for torch's Work ``work`` (None: a synchronous op on the
    current stream, for which ProcessGroupNCCL makes no Work)."""
    if work is not None:
        work.wait()


def nccl_reduces(dtype: str, reduce_op: str) -> bool:
    """Whether NCCL reduces ``dtype`` (chorus's name) with ``reduce_op`` as chorus would.

    >>> nccl_reduces("bfloat16", "AVG"), nccl_reduces("int16", "SUM"), nccl_reduces("int32", "BXOR")
    (True, False, False)
    """
    return dtype in NCCL_REDUCE_DTYPES and reduce_op in NCCL_OPS


def as_bytes(tensor):
    """A flat contiguous tensor's bytes, for NCCL ops that only move data."""
    import torch

    return tensor.view(torch.uint8)


def nccl_available() -> bool:
    """Whether torch here has NCCL."""
    try:
        import torch.distributed as dist

        return bool(dist.is_nccl_available())
    except ImportError:
        return False


def torch_store(key: str, chorus_store, first: bool, host: str, timeout_s: float):
    """A torch ``TCPStore`` served by the ``first`` member on a free port of ``host``; the
    others read its address from ``chorus_store`` under ``key``."""
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


def serving_host(transport) -> str:
    """The address this rank serves a store on: the host its TCP ``transport`` listens on
    (where the other hosts already reach it), else CHORUS_SOCKET_HOST, else loopback."""
    return getattr(transport, "listen_host", None) or config.get("CHORUS_SOCKET_HOST") or "127.0.0.1"


#: a message over one two-shot round of the workspace goes to NCCL from this size on, under
#: CHORUS_CUDA_NCCL_FROM_BYTES too: in two rounds two_shot_push took 151.4 us at 16 MiB
#: against NCCL's 96.7 (docs/results/4xh200/calibrate-nccl-bf16-w4.json) and 166.2 against
#: 111.8 (speed-run-7/handoff_from.log), in one round 58.1 at 8 MiB against 60.2
#: (speed-run-7/two-shot-shape/); below it, a small workspace's rounds stay chorus's
ROUNDS_NCCL_FROM_BYTES = 8 << 20


def nccl_from(layout) -> int:
    """The all_reduce size from which a group with workspace ``layout`` (None: none) hands
    off: CHORUS_CUDA_NCCL_FROM_BYTES (0: never), or, where smaller, the most bytes one
    two-shot round holds (a 64 MiB workspace: 13.9 MiB), but not under
    ROUNDS_NCCL_FROM_BYTES.

    >>> from chorus.cuda.layout import Layout
    >>> nccl_from(Layout.of(4, 64 << 20)) / 2**20, nccl_from(Layout.of(4, 4 << 20)) / 2**20
    (13.9140625, 8.0)
    """
    setting = config.get("CHORUS_CUDA_NCCL_FROM_BYTES")
    if not setting or layout is None:
        return setting
    one_round = two_shot_chunk(layout.slot, 16, layout.world) * 16  # (16: the widest item, the fewest bytes)
    return min(setting, max(one_round, ROUNDS_NCCL_FROM_BYTES))


def nccl_handoff(pg) -> bool:
    """Whether any of ``pg``'s calls may go to NCCL: torch has it,
    CHORUS_CUDA_NCCL_FROM_BYTES is not 0 (0 keeps every call on chorus's kernels), and the
    group is not itself a hidden sub-group (whose ids leave no room for one more
    level: a host's sub-group under the rails, which already run NCCL between hosts)."""
    return bool(config.get("CHORUS_CUDA_NCCL_FROM_BYTES")) and not pg.id & HIDDEN and nccl_available()


#: the hidden sub-group index of a group's NCCL fingerprint agreement (after the
#: hierarchy's leaders, hosts and rails)
NCCL_INDEX = (1 << 12) - 1


def group_peers(pg) -> NcclPeers:
    """Group ``pg``'s NCCL communicator's members, over a hidden sub-group of all of it
    (collective: every rank at the same op).  Each communicator a group makes (one per
    CUDA component of it: a component attached again after close, or a second one beside
    the API's) has its own store key: a member reading the last one's address would meet
    NCCL's bootstrap of a communicator already made (connection refused)."""
    key = address_key(f"cuda/{pg.id}/nccl", pg.size())
    sub = hidden_subgroup(pg, NCCL_INDEX, tuple(range(pg.size())), f"{pg.name}/nccl")
    select.attach(sub, settings=False)
    return NcclPeers(pg, tuple(range(pg.size())), sub, key)


def address_key(communicator: str, members: int) -> str:
    """The job store's key for the address of ``communicator``'s store, one per time its
    ``members`` make it (each member adds once per communicator, in the same order).

    ``address_key("cuda/0/nccl", 4)`` on each of 4 ranks: "cuda/0/nccl/0/address"; the
    next communicator of those ranks: "cuda/0/nccl/1/address"."""
    from chorus.api.state import current

    made = (current().store.add(f"{communicator}/made", 1) - 1) // members
    return f"{communicator}/{made}/address"


class NcclPeers:
    """Group ranks ``ranks`` of chorus group ``pg`` (this rank among them) on one NCCL
    communicator.  ``agree_on``: a chorus group of exactly those ranks, whose CPU path
    compares fingerprints; ``key``: where the communicator's store address goes in
    chorus's store (unique to this communicator in the job); ``break_groups``: the chorus
    groups a mismatch breaks on every member (``pg`` at least; not ``agree_on``: every
    member reaches the all_gather that names the calls, and a notice breaking its group
    would fail that all_gather half-way on a slower member, with a message about chorus's
    own ops instead of the user's)."""

    def __init__(self, pg, ranks: tuple[int, ...], agree_on, key: str, break_groups: tuple = ()):
        self.pg = pg
        self.ranks = ranks
        self.index = ranks.index(pg.rank())
        self.agree_on = agree_on
        self.key = key
        self.break_groups = break_groups or (pg,)
        self.nccl = None  # torch's ProcessGroupNCCL, made at the first op
        self.store = None  # the torch store it is made over
        self.broken: BaseException | None = None
        self.aborting: threading.Thread | None = None  # the failure listener's abort, while it runs
        self.reduce_options: dict = {}  # (reduce op, wait) -> torch's AllreduceOptions for them
        self.watching: threading.Event | None = None  # set to stop watch()'s thread
        self.watcher: threading.Thread | None = None
        self.aborted = False  # once set, the communicator is never made (again)
        self.lock = threading.Lock()  # abort_soon and watch come from several threads
        pg.transport.add_failure_listener(self._on_failure)

    def agree(self, call) -> None:
        """Every member called ``call``'s op (its fingerprint), or CollectiveMismatchError
        naming both calls, on every member, and nothing queued."""
        if self.broken is not None:
            raise self.broken
        fp = call.fingerprint - (1 << 64) if call.fingerprint >= 1 << 63 else call.fingerprint
        extremes = np.array([fp, ~fp], dtype=np.int64)  # (max, ~min) over the members: both mine iff all agree
        lane = getattr(self.agree_on, "lane", None)
        if lane is not None and lane.all_reduce_now(extremes, ReduceOp.MAX):
            if extremes[0] == fp and extremes[1] == ~fp:
                return
        # the members' calls, to name who called what (every member comes here together:
        # each saw the same max and min)
        mine = np.array([call.fingerprint], dtype=np.uint64)
        got = np.empty(len(self.ranks), dtype=np.uint64)
        select.start(make(self.agree_on, "all_gather", dtype="uint64", count=1,
                          buffers={"input": mine, "output": got}, async_op=False, algorithm=None, nbytes=8,
                          args={"count": 1}))
        if (got == mine[0]).all():
            return
        members = self.pg.members
        other = int(next(g for g in got if g != mine[0]))
        ours = [members[r] for r, g in zip(self.ranks, got, strict=True) if g == mine[0]]
        theirs = [members[r] for r, g in zip(self.ranks, got, strict=True) if g == other]
        self.broken = CollectiveMismatchError(
            f"{call.name} #{call.seq} on group {self.pg.name}: rank(s) {ours} called {describe(call.fingerprint)} "
            f"but rank(s) {theirs} called {describe(other)}; every rank of a group must call the same "
            "collectives in the same order")
        t = self.pg.transport
        culprit = members[self.ranks[list(got).index(other)]]
        for sub in self.break_groups:
            t.group_mismatch(sub.id, culprit, call.seq, other, t.rank)
        raise self.broken

    def group(self):
        """The ProcessGroupNCCL (made at the first call: collective over the members);
        after an abort, the error that caused it (never a new communicator: the other
        members would not make one with it)."""
        if self.nccl is None:
            import torch.distributed as dist

            from chorus.api.state import current

            if not self.aborted:
                chorus_store = current().store
                self.store = torch_store(self.key, chorus_store, self.index == 0,
                                         serving_host(self.pg.transport), self.pg.timeout)
                made = dist.ProcessGroupNCCL(self.store, self.index, len(self.ranks))
                with self.lock:  # (an abort meanwhile: this one, with no communicator yet, is dropped)
                    if not self.aborted:
                        self.nccl = made
            if self.nccl is None:
                self.check()
                raise AbortedError(f"group {self.pg.name}: its NCCL communicator was aborted after a failure; "
                                   "make a new group (or re-initialize) to go on")
        return self.nccl

    def run(self, call) -> None:
        """Queue chorus Call ``call``'s op (all_reduce, all_gather, all_to_all, broadcast
        or reduce_scatter) on the communicator, after the current stream's work."""
        b = call.buffers
        if call.name == "all_reduce":
            self.all_reduce(b["data"], call.reduce_op)
        elif call.name == "broadcast":
            self.broadcast(b["data"], self.ranks.index(call.root))
        elif call.name == "all_gather":
            self.all_gather(b["output"], b["input"])
        elif call.name == "all_to_all":
            self.all_to_all(b["output"], b["input"], call.args["send_counts"], call.args["recv_counts"])
        else:
            self.reduce_scatter(b["output"], b["input"], call.reduce_op)

    def all_reduce(self, tensor, reduce_op: str, wait: bool = True):
        """``tensor`` = NCCL's all_reduce of it over the members (enqueued; the current
        stream waits for it unless ``wait`` is False: then NCCL's stream runs it, as
        ProcessGroupNCCL's async ops, and the caller's goes on); torch's Work of it (None
        where a synchronous op made none: see on_current_stream)."""
        opts = self.reduce_options.get((reduce_op, wait))
        if opts is None:  # (made once per op: each costs microseconds a call would pay)
            import torch.distributed as dist

            opts = dist.AllreduceOptions()
            opts.reduceOp = getattr(dist.ReduceOp, NCCL_OPS[reduce_op])
            self.reduce_options[(reduce_op, wait)] = on_current_stream(opts) if wait else opts
        work = (self.nccl or self.group()).allreduce([tensor], opts)
        if wait:
            waited(work)
        return work

    def all_gather(self, output, tensor) -> None:
        """``output`` (W blocks) = every member's ``tensor``, in member order (enqueued
        likewise)."""
        from torch.distributed import distributed_c10d

        # (AllgatherOptions: torch.distributed does not re-export it)
        opts = on_current_stream(distributed_c10d.AllgatherOptions())
        waited(self.group()._allgather_base(as_bytes(output), as_bytes(tensor), opts))

    def reduce_scatter(self, output, tensor, reduce_op: str) -> None:
        """``output`` = NCCL's reduction of block i (this member's index) of every
        member's ``tensor`` (W blocks), enqueued likewise."""
        import torch.distributed as dist

        opts = on_current_stream(dist.ReduceScatterOptions())
        opts.reduceOp = getattr(dist.ReduceOp, NCCL_OPS[reduce_op])
        waited(self.group()._reduce_scatter_base(output, tensor, opts))

    def all_to_all(self, output, tensor, send_counts, recv_counts) -> None:
        """``output`` = block i of every member's ``tensor``, in member order (1-D tensors:
        ``send_counts[j]`` elements go to member j, ``recv_counts[j]`` come from it),
        enqueued likewise.  The splits are always given: whether a rank's own splits
        are all equal differs from rank to rank, and torch runs equal splits as another
        NCCL operation than uneven ones, which the other ranks would never match."""
        import torch.distributed as dist

        item = tensor.element_size()
        waited(self.group().alltoall_base(as_bytes(output), as_bytes(tensor), [c * item for c in recv_counts],
                                          [c * item for c in send_counts], on_current_stream(dist.AllToAllOptions())))

    def broadcast(self, tensor, root: int) -> None:
        """``tensor`` = member ``root``'s (its index in ``ranks``), enqueued likewise."""
        import torch.distributed as dist

        opts = on_current_stream(dist.BroadcastOptions())
        opts.rootRank = root
        waited(self.group().broadcast([as_bytes(tensor)], opts))

    def abort(self) -> None:
        """Abort the communicator (NCCL's kernels stop waiting); idempotent."""
        with self.lock:
            nccl, self.nccl = self.nccl, None
        if nccl is not None:
            stop = getattr(nccl, "abort", None) or getattr(nccl, "shutdown", None)
            if stop is not None:
                stop()

    def close(self) -> None:
        """Abort the communicator and let its store go.  An abort a failure listener
        started is waited for, at most ABORT_WAIT_S: a process that exits while NCCL is
        still aborting on another thread ends in std::terminate (SIGABRT), after the
        PeerLostError every op raised."""
        self.pg.transport.remove_failure_listener(self._on_failure)
        with self.lock:
            self.aborted = True
            watching, watcher = self.watching, self.watcher
        if watching is not None:
            watching.set()
            if watcher is not None:  # (it reads the workspace's control page, which the caller unmaps next)
                watcher.join(ABORT_WAIT_S)
        self.abort()
        aborting = self.aborting
        if aborting is not None:
            aborting.join(ABORT_WAIT_S)
        self.store = None

    def abort_soon(self) -> None:
        """Abort the communicator from a thread of its own (NCCL's abort can take seconds
        and the callers must not block), once; one not made yet never will be."""
        with self.lock:
            if self.aborted:
                return
            self.aborted = True
            if self.nccl is not None:
                self.aborting = threading.Thread(target=self.abort, name="chorus-nccl-abort", daemon=True)
                self.aborting.start()

    def watch(self, words, index: int) -> None:
        """Abort the communicator once ``words[index]`` (a word of host memory that the
        barrier beside NCCL's kernel writes when it finds the ranks' ops differ:
        chorus.cuda.beside) is non-zero, looking every WATCH_S seconds from a daemon
        thread, until close(): NCCL's kernel would otherwise wait forever for peers that
        called another op, and so would whoever synchronizes with it."""
        if self.watching is not None:  # (every handed-off call asks: no lock once it runs)
            return
        with self.lock:
            if self.watching is not None:
                return
            self.watching = stop = threading.Event()

        def look() -> None:
            while not stop.wait(WATCH_S):
                if words[index]:
                    self.abort_soon()
                    return

        with self.lock:
            self.watcher = threading.Thread(target=look, name="chorus-nccl-watch", daemon=True)
            self.watcher.start()

    def _on_failure(self, group: int, why: str) -> None:
        dead = self.pg.transport.dead
        if group in (self.pg.id, self.agree_on.id) or (group == -1 and any(m in dead for m in self.pg.members)):
            self.abort_soon()

    def check(self) -> None:
        """Raise what broke these peers (a mismatch), or the group's failure."""
        if self.broken is not None:
            raise self.broken
        failure = self.pg.transport.failure(self.pg.id, None)
        if failure is not None:
            raise failure
