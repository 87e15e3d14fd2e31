"""``CudaComponent``: collectives and point-to-point of CUDA tensors for one group.

``attach(pg)`` is what the API calls (by name) when a group sees its first CUDA call;
every member calls it at that call, and it is collective: the members allocate and map
a workspace (chorus.cuda.workspace) and check it by a real transfer.  If that fails
anywhere, every member logs one line saying why and the component stages every op
through pinned host memory instead (chorus.cuda.staging).

Per call, with a mapped workspace::

    supports(call)   a CUDA call: "one_shot" (collectives), "channels" (all_to_all),
                     "barrier"; "staging" for reductions of dtypes the kernels lack
    start(call)      enqueue the algorithm (chorus.cuda.algorithms) on the group's
                     stream, in issue order; return at once (async_op: a CudaWork
                     holding an event recorded after it)
    p2p(...)         a send or receive through the pair's channel

Streams, as ProcessGroupNCCL's: every op of a group runs on the group's own stream
(one per workspace), which first waits for the caller's current stream, so an op runs
after the caller's queued work, and ops issued from different streams (FSDP's
all-gather and reduce-scatter streams) still run in issue order, which the barrier
epochs and slot parities rely on.  A synchronous op makes the caller's stream wait for
it; an async one records an event on the group's stream, which ``work.wait()`` makes the
current stream wait for, and its buffers are marked in use there (``record_stream``).
A synchronous ``barrier`` also blocks the CPU until it completed (as torch's).

Failures: every spin is bounded by the group's timeout and by the ABORT word that a
transport failure listener sets (chorus.cuda.kernels).  A kernel that gives up writes
why into the control page; the next call on the group, and ``CudaWork.wait`` /
``synchronize``, read it and raise: CollectiveMismatchError when a barrier found ranks
in another collective (naming both calls; the transport is told, so the group's CPU ops
fail too), PeerLostError or CollectiveMismatchError when the transport knows of one,
else CommTimeoutError, AbortedError or BufferMismatchError, naming the op, the group
and the ranks.  From then on the component is broken: every later call raises the same.
"""

from __future__ import annotations

import logging
import threading
import time

from chorus import config
from chorus.call import Call
from chorus.components import select
from chorus.components.base import Component, run_in_order
from chorus.cuda import algorithms as A
from chorus.cuda import layout as L
from chorus.cuda import staging
from chorus.engine import OpContext
from chorus.errors import (
    AbortedError,
    BufferMismatchError,
    CollectiveMismatchError,
    CommTimeoutError,
    InvalidArgumentError,
    PeerLostError,
)
from chorus.wire.fingerprint import describe
from chorus.work import Work

log = logging.getLogger("chorus")

DEFAULT_WORKSPACE_BYTES = 64 << 20
OP_NAMES_KEPT = 4096  # op descriptions kept for error messages
_U64 = (1 << 64) - 1
_ALGORITHMS = {"all_to_all": "channels", "barrier": "barrier"}  # everything else: "one_shot"


def setting(name: str, default: int) -> int:
    """A CHORUS_CUDA_* setting (declared in chorus.config)."""
    value = config.get(name)
    if value in (None, ""):
        return default
    return int(value)


def is_cuda(call: Call) -> bool:
    device = getattr(call, "device", None)
    if device is not None:
        return device == "cuda"
    return any(getattr(t, "is_cuda", False) for t in call.buffers.values())


def attach(pg) -> CudaComponent:
    """The CUDA component of group ``pg`` (collective: every member calls it, at the same
    call).  The caller puts it first in ``pg.components``."""
    from chorus.api.state import current
    from chorus.cuda.workspace import Unusable, Workspace

    store = current().store
    total = setting("CHORUS_CUDA_WORKSPACE_BYTES", DEFAULT_WORKSPACE_BYTES)
    generation = (store.add(f"cuda/{pg.id}/attaches", 1) - 1) // pg.size()
    prefix = f"cuda/{pg.id}/{generation}"
    why = "CHORUS_CUDA_STAGING=1" if setting("CHORUS_CUDA_STAGING", 0) else ""
    ws = None
    if not why:
        try:
            ws = Workspace.create(pg, store, prefix, total)
        except (Unusable, ImportError) as exc:
            why = str(exc)
    if ws is None:
        log.warning("chorus rank %d: group %s stages CUDA tensors through host memory: %s",
                    pg.members[pg.rank()], pg.name, why)
    return CudaComponent(pg, ws, why)


class CudaComponent(Component):
    """Group ``pg``'s CUDA component over workspace ``ws`` (None: staging, ``why``)."""

    name = "cuda"

    def __init__(self, pg, ws, why: str = ""):
        self.pg = pg
        self.ws = ws
        self.staging_reason = why
        self.lanes = None
        self._reducible: frozenset[str] = frozenset()
        self.ops: dict[int, tuple[str, int, int]] = {}  # op id -> (description, seq, fingerprint)
        self.next_op = 0
        self.broken: BaseException | None = None
        self._lock = threading.Lock()  # one enqueuer at a time (p2p may come from another thread)
        if ws is not None:
            from chorus.cuda.kernels import REDUCIBLE
            from chorus.cuda.lanes import Lanes

            self.lanes = Lanes(ws, pg.timeout)
            self._reducible = REDUCIBLE
            pg.transport.add_failure_listener(self._on_failure)

    # -- Component ---------------------------------------------------------------------------------
    def supports(self, call: Call) -> str | None:
        if not is_cuda(call):
            return None
        if self.lanes is None or call.algorithm == "staging":
            return "staging"
        if call.reduce_op and staging.torch_dtype_name(_first(call)) not in self._reducible:
            return "staging"
        return _ALGORITHMS.get(call.name, "one_shot")

    def start(self, call: Call, algorithm: str):
        if algorithm == "staging":
            return staging.start(call, algorithm, select.start)
        import torch

        self.check(call.name)
        stream = torch.cuda.current_stream(self.ws.device)
        side = self.ws.stream
        op_id = self._name_op(f"{call.name} (op #{call.seq} of group {self.pg.name})", call.seq,
                              call.fingerprint)
        side.wait_stream(stream)  # after the caller's queued work (its before-hook included)
        sync = call._replace(async_op=False, before=_on(call.before, side), after=_on(call.after, side))

        def transfers(ctx) -> None:
            self._launch(lambda run: self._enqueue(call, ctx, op_id, run))

        run_in_order(sync, self.name, algorithm, _on(transfers, side))
        if not call.async_op:
            stream.wait_stream(side)  # the caller's later work sees the result
            if call.name == "barrier":
                stream.synchronize()  # torch's barrier blocks the CPU
                self.check(call.name)
            return None
        _keep(call.buffers.values(), side)
        return self._work(side, call.name, call.result, call.buffers)

    def close(self) -> None:
        if self.ws is not None:
            self.pg.transport.remove_failure_listener(self._on_failure)
            self.ws.close()
            self.ws = self.lanes = None

    # -- point-to-point ------------------------------------------------------------------------------
    def p2p(self, kind: str, tensor, peer: int, tag: int, async_op: bool):
        """Send ``tensor`` to (kind "send") or receive it from ("recv") group rank ``peer``;
        sends and receives of a pair match in issue order, and the tags must agree."""
        return self.p2p_batch([(kind, tensor, peer, tag)], async_op)

    def p2p_batch(self, ops, async_op: bool):
        """Several sends and receives ((kind, tensor, peer, tag) each) at once, chunk by
        chunk, so no order of them deadlocks (batch_isend_irecv)."""
        if self.lanes is None:
            works = [staging.p2p(self.pg, kind, t, peer, tag, True) for kind, t, peer, tag in ops]
            if not async_op:
                for w in works:
                    w.wait()
                return None
            return _All(works, [t for _, t, _, _ in ops])
        import torch

        kinds = {kind for kind, *_ in ops}
        self.check("/".join(sorted(kinds)))
        stream = torch.cuda.current_stream(self.ws.device)
        what = ", ".join(f"{k} {'to' if k == 'send' else 'from'} rank {self.pg.members[p]} (tag {g})"
                         for k, _, p, g in ops)
        op_id = self._name_op(what)
        ctx = OpContext("send" if kinds == {"send"} else "recv" if kinds == {"recv"} else "p2p",
                        self.pg.id, -1, 0, self.pg.members, None)

        def message(t, peer, tag):
            return peer, t.data_ptr(), t.numel() * t.element_size(), tag

        def enqueue(run) -> None:
            with self._lock:
                self.lanes.begin(op_id, ctx, run.cuda_stream)
                A.exchange(self.lanes, [message(t, p, g) for k, t, p, g in ops if k == "send"],
                           [message(t, p, g) for k, t, p, g in ops if k == "recv"], True)

        side = self.ws.stream
        side.wait_stream(stream)
        self._launch(enqueue)
        if not async_op:
            stream.wait_stream(side)
            return None
        _keep([t for _, t, _, _ in ops], side)
        return self._work(side, what, [t for _, t, _, _ in ops], tuple(t for _, t, _, _ in ops))

    # -- failures ------------------------------------------------------------------------------------
    def check(self, what: str) -> None:
        """Raise the group's error, if it has one (see the module docstring)."""
        if self.broken is not None:
            raise self.broken
        if self.ws is None:
            return
        words = self.ws.words
        if words[L.TAG_OP]:
            self._tag_mismatch(words)
        if not words[L.STATUS] and self.pg.transport.failure(self.pg.id, None) is None:
            return
        self.broken = self._error(what, words)
        words[L.ABORT] = 1  # the rest of the queue fails fast
        raise self.broken

    def _tag_mismatch(self, words) -> None:
        op = self._described(int(words[L.TAG_OP]) - 1, "a receive")
        peer = self.pg.members[int(words[L.TAG_PEER])]
        expect, got = (_tag(int(words[i])) for i in (L.TAG_EXPECT, L.TAG_GOT))
        words[L.TAG_OP] = 0
        raise InvalidArgumentError(
            f"{op} on group {self.pg.name}: this rank expected tag {expect} but rank {peer}'s matching "
            f"send has tag {got}; sends and receives between two ranks match in issue order, so "
            "post them in the same order on both sides with the same tags")

    def _error(self, what: str, words) -> BaseException:
        status = int(words[L.STATUS])
        if status == L.MISMATCH:
            return self._mismatch(words)
        description, seq, fprint = self.ops.get(int(words[L.FAIL_OP]), ("an earlier op", -1, 0))
        op = description if status else "an op"
        expect = (seq, fprint) if status and fprint else None  # names this rank's call in a mismatch
        lost = self.pg.transport.failure(self.pg.id, None, expect=expect)
        bits = int(words[L.FAIL_PEERS])
        ranks = [self.pg.members[r] for r in range(bits.bit_length()) if bits >> r & 1]
        waited = {L.WAIT_BARRIER: "arrive at its barrier", L.WAIT_READY: "send its data",
                  L.WAIT_ACK: "take the previous data out of this rank's channel"}.get(int(words[L.FAIL_WHAT]), "")
        where = f"{what} on group {self.pg.name} (CUDA)"
        if lost is not None:
            if isinstance(lost, PeerLostError):
                return PeerLostError(f"{where}: {lost}", lost.lost_rank, lost.reporter)
            return type(lost)(f"{where}: {lost}")
        if status == L.TIMEOUT:
            return CommTimeoutError(
                f"{where}: {op} timed out after {self.pg.timeout:g} s waiting for rank(s) {ranks} to {waited}; "
                "they are hung, slow, or called another op. The group's CUDA ops are unusable from now on.")
        if status == L.SIZE_MISMATCH:
            return BufferMismatchError(
                f"{where}: in {op}, rank(s) {ranks} sent {int(words[L.FAIL_GOT])} bytes but this rank "
                f"receives {int(words[L.FAIL_EXPECT])}; post receives of the sender's size. "
                "The group's CUDA ops are unusable from now on.")
        return AbortedError(f"{where}: {op} was aborted while waiting for rank(s) {ranks} "
                            "(the group failed or was destroyed)")

    def _mismatch(self, words) -> CollectiveMismatchError:
        """A barrier of op FAIL_OP found ranks FAIL_PEERS in another collective (the lowest
        of them called FAIL_FP): tell the transport (the group's CPU ops fail too, on every
        rank) and name both calls."""
        _, seq, mine = self.ops.get(int(words[L.FAIL_OP]), ("", -1, 0))
        bits = int(words[L.FAIL_PEERS])
        others = [self.pg.members[r] for r in range(bits.bit_length()) if bits >> r & 1]
        culprit, theirs = others[0], int(words[L.FAIL_FP]) & _U64
        me = self.pg.members[self.pg.rank()]
        self.pg.transport.group_mismatch(self.pg.id, culprit, seq, theirs, me)
        also = f" (ranks {others} all called something other than this rank)" if len(others) > 1 else ""
        return CollectiveMismatchError(
            f"collective mismatch on group {self.pg.name} (CUDA): rank {culprit} called {describe(theirs)} "
            f"as op #{seq} of the group{also}, but this rank (rank {me}) called {describe(mine & _U64)}. "
            "The group is unusable from now on. Every rank of a group must call the same collectives, "
            "in the same order, with the same dtype, count, root and op.")

    def _on_failure(self, group: int, why: str) -> None:
        ws = self.ws
        if ws is None:
            return
        dead = self.pg.transport.dead
        if group == self.pg.id or (group == -1 and any(m in dead for m in self.pg.members)):
            ws.words[L.ABORT] = 1

    # -- helpers -------------------------------------------------------------------------------------
    def _name_op(self, description: str, seq: int = -1, fprint: int = 0) -> int:
        op_id = self.next_op = self.next_op + 1
        self.ops[op_id] = (description, seq, fprint)
        if len(self.ops) > OP_NAMES_KEPT:
            del self.ops[next(iter(self.ops))]
        return op_id

    def _described(self, op_id: int, otherwise: str) -> str:
        entry = self.ops.get(op_id)
        return entry[0] if entry is not None else otherwise

    def _launch(self, enqueue) -> None:
        """``enqueue(run)`` puts an op's work on the group's own stream ``run`` (which the
        caller has made wait for its stream), on the workspace's device.

        One stream per group, as ProcessGroupNCCL's: ops issued from different caller
        streams (FSDP's all-gather and reduce-scatter streams) still run on the GPU in
        issue order, which the barrier epochs and slot parities rely on."""
        import torch

        side = self.ws.stream
        with torch.cuda.device(side.device), torch.cuda.stream(side):
            enqueue(side)

    def _work(self, stream, what: str, result, keep):
        import torch

        from chorus.cuda.work import CudaWork

        event = torch.cuda.Event()
        event.record(stream)
        return CudaWork(event, lambda: self.check(what), result, (keep,))

    def _enqueue(self, call: Call, ctx, op_id: int, stream) -> None:
        b = call.buffers
        first = _first(call)
        dtype = staging.torch_dtype_name(first) if first is not None else ""
        item = first.element_size() if first is not None else 1
        with self._lock:
            x = self.lanes
            x.begin(op_id, ctx, stream.cuda_stream, dtype, call.reduce_op, call.fingerprint)
            name = call.name
            if name == "barrier":
                x.barrier()
            elif name == "all_reduce":
                A.all_reduce(x, b["data"].data_ptr(), b["data"].numel(), item)
            elif name == "reduce":
                A.reduce(x, b["data"].data_ptr(), b["data"].numel(), item, call.root)
            elif name == "broadcast":
                A.broadcast(x, b["data"].data_ptr(), b["data"].numel(), item, call.root)
            elif name in ("all_gather", "gather"):
                out = b["output"].data_ptr() if "output" in b else None
                A.all_gather(x, b["input"].data_ptr(), out, b["input"].numel(), item,
                             call.root if name == "gather" else -1)
            elif name == "scatter":
                inp = b["input"].data_ptr() if "input" in b else None
                A.scatter(x, inp, b["output"].data_ptr(), b["output"].numel(), item, call.root)
            elif name == "reduce_scatter":
                A.reduce_scatter(x, b["input"].data_ptr(), b["output"].data_ptr(), tuple(call.args["counts"]), item)
            elif name == "all_to_all":
                A.all_to_all(x, b["input"].data_ptr(), b["output"].data_ptr(), call.args["send_counts"],
                             call.args["recv_counts"], item)
            else:
                raise InvalidArgumentError(f"chorus.cuda cannot run {name}")


def _first(call: Call):
    return next((t for t in call.buffers.values() if hasattr(t, "is_cuda")), None)


def _tag(tag: int) -> str:
    return "(all_to_all)" if tag == A.EXCHANGE_TAG else str(tag)


class _All(Work):
    """Several Works as one (an async staged p2p_batch)."""

    def __init__(self, works: list, result: list):
        super().__init__(result)
        self.works = works

    def _wait(self, deadline: float | None) -> None:
        for w in self.works:
            w.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _poll(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def _watch(self) -> None:
        left = [len(self.works)]

        def one(_) -> None:
            left[0] -= 1
            if left[0] == 0:
                self.is_completed()

        for w in self.works:
            w.get_future().add_done_callback(one)


def _on(fn, stream):
    """``fn`` run with ``stream`` (and its device) current, from whatever thread."""
    if fn is None:
        return None
    import torch

    def run(*args):
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            return fn(*args)

    return run


def _keep(tensors, stream) -> None:
    """Tell torch's caching allocator that ``tensors`` are in use on ``stream`` (an async
    op's buffers: their memory is not reused before the op is done there)."""
    for t in tensors:
        t.record_stream(stream)
