"""``CudaComponent``: collectives and point-to-point of CUDA tensors for one group.

``attach(pg)`` is what the API calls (by name) when a group sees its first CUDA call;
every member calls it at that call, and it is collective: the members allocate and map
a workspace (chorus.cuda.workspace) and check it by a real transfer.  If that fails
anywhere, every member logs one line saying why and the component stages every op
through pinned host memory instead (chorus.cuda.staging).

Per call, with a mapped workspace::

    supports(call)   a CUDA call: all_reduce "one_shot" / "two_shot_push" by size (or
                     "two_shot", "two_shot_stores", "copy_reduce", by name), "nccl" from
                     CHORUS_CUDA_NCCL_FROM_BYTES (NCCL's kernels on a communicator of
                     the group's: chorus.cuda.nccl; all_gather and reduce_scatter from
                     CHORUS_CUDA_NCCL_GATHER_FROM_BYTES, all_to_all and broadcast with
                     CHORUS_CUDA_NCCL_ALL_TO_ALL, _BROADCAST), "fused" (all_gather,
                     reduce_scatter), "one_shot" (other collectives), "channels"
                     (all_to_all), "barrier"; "staging" for reductions of dtypes the kernels lack
    all_reduce_now   an all_reduce from a cached plan (chorus.cuda.plans), with none of
                     the general path's per-call objects (the API's latency lane);
    rows_now         the same for all_gather_into_tensor and reduce_scatter_tensor
    start(call)      enqueue the algorithm (chorus.cuda.algorithms) on the caller's
                     current stream, in issue order; return at once (async_op: a
                     CudaWork holding an event recorded after it); inside a CUDA graph
                     capture, all_reduce only (chorus.cuda.capture)
    p2p(...)         a send or receive through the pair's channel

Streams, as ProcessGroupNCCL's contract: an op is enqueued on the caller's current stream
(after the work queued there; later work there runs after it, except an async hand-off's,
below); synchronous calls return once enqueued; ``async_op`` gives a CudaWork holding an
event recorded after the op.  The ops of a group still run on the GPU in issue order when
they come from several streams (``_follow``): an op on another stream than the group's
last op makes its stream wait for that op first.  An async all_reduce handed to NCCL (the
lane's, once the communicator exists) runs on NCCL's stream as ProcessGroupNCCL's do: the
caller's stream waits for it at ``wait()``, and the group's next op on chorus's kernels
runs after it (the stream beside learns of its end when such an op comes, not per
hand-off: chorus.cuda.beside).  A synchronous ``barrier`` also blocks the CPU until it
completed (as torch's).

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
from functools import partial
from types import SimpleNamespace

from chorus import config, recorder
from chorus.call import Call
from chorus.components import select
from chorus.components.base import Component, run_in_order
from chorus.cuda import algorithms as A
from chorus.cuda import capture, failures, p2p, setup, staging
from chorus.cuda import layout as L
from chorus.cuda.beside import Beside
from chorus.cuda.failures import OpNames
from chorus.cuda.nccl import NcclPeers, group_peers, nccl_from, nccl_handoff, nccl_reduces
from chorus.cuda.plans import PLANS, LaneLog, cached_plan, rows_plan
from chorus.cuda.staging import is_cuda
from chorus.cuda.work import CudaWork
from chorus.debug import flight

log = logging.getLogger("chorus")

_ALGORITHMS = {"all_to_all": "channels", "barrier": "barrier"}  # everything else: "one_shot"


def attach(pg) -> CudaComponent:
    """The CUDA component of group ``pg`` (collective: every member calls it, at the same
    call): on its workspace (chorus.cuda.setup), else, across hosts, rails, else staged.
    The caller puts it first in ``pg.components``."""
    if capture.capturing():
        raise capture.first_use_error(pg.name)
    ws, why = setup.workspace(pg)
    if ws is None:
        from chorus.cuda.rails import attach as rails

        across = rails(pg, why)  # several hosts: chorus inside each, a communicator per rail between
        if across is not None:
            return across
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
        self.names = OpNames(pg.name)  # the ids the kernels report ops by
        self.broken: BaseException | None = None
        self._last_stream = None  # the stream of the group's last op, and its raw handle (_follow)
        self._last_raw = 0
        self.lock = threading.Lock()  # one enqueuer at a time (p2p may come from another thread)
        self._plans: dict = {}  # all_reduce_now's plans (chorus.cuda.plans; False: the general path)
        self._lane_log: LaneLog | None = None
        # calls on NCCL's kernels (_on_nccl; a communicator made at the first); a staged
        # group (no workspace) stages every call, large ones too (supports)
        handoff = self._handoff = nccl_handoff(pg) and ws is not None
        self._nccl_from = nccl_from(ws.layout if ws is not None else None) if handoff else 0
        self._nccl_gather_from = config.get("CHORUS_CUDA_NCCL_GATHER_FROM_BYTES") if handoff else 0
        self._nccl_exchange = handoff and config.get("CHORUS_CUDA_NCCL_ALL_TO_ALL")
        self._nccl_broadcast = handoff and config.get("CHORUS_CUDA_NCCL_BROADCAST")
        self._nccl = None
        self._nccl_guard = config.get("CHORUS_CUDA_NCCL_AGREE") == "gpu" and ws is not None
        self._beside = None  # the stream of that agreement's barriers (made at the first)
        self._device_index = -1
        self._torch = None
        if ws is not None:
            import torch

            self._torch = torch
            self._device_index = ws.device.index
            from chorus.cuda.lanes import Lanes
            from chorus.cuda.launchers import REDUCIBLE

            self.lanes = Lanes(ws, pg.timeout, names=self.names)
            self._reducible = REDUCIBLE
            ring = flight.attach(pg)
            self._lane_log = None if ring is None else LaneLog(ring)  # the lane's ops, for the flight recorder
            pg.transport.add_failure_listener(self._on_failure)

    # -- Component ---------------------------------------------------------------------------------
    def supports(self, call: Call) -> str | None:
        if not is_cuda(call):
            return None
        if self.lanes is None or call.algorithm == "staging":
            return "staging"
        if call.reduce_op and staging.torch_dtype_name(_first(call)) not in self._reducible:
            return "staging"
        if call.name == "all_reduce":
            if call.algorithm in A.ALL_REDUCE_ALGORITHMS:
                return call.algorithm
            if self._on_nccl(call):
                return "nccl"
            return A.all_reduce_algorithm(call.nbytes, self.pg.size())
        if call.name in ("all_gather", "reduce_scatter", "all_to_all", "broadcast") and self._on_nccl(call):
            return "nccl"
        if call.name in ("all_gather", "reduce_scatter") and call.algorithm != "one_shot":
            first = _first(call)
            if (call.name == "all_gather" and first.element_size() in A.GATHER_ITEMS) or (
                    call.name == "reduce_scatter" and len(set(call.args["counts"])) == 1):
                return "fused"  # one kernel a round (chorus.cuda.gather); "one_shot": copies
        return _ALGORITHMS.get(call.name, "one_shot")

    def start(self, call: Call, algorithm: str):
        if capture.capturing():
            capture.check(call.name, algorithm, self.pg.name)
            if algorithm != "nccl":
                return self._start_captured(call, algorithm)
        if algorithm == "staging":
            return staging.start(call, algorithm, select.start)
        if algorithm == "nccl":
            return self._start_nccl(call)
        import torch

        self.check(call.name)
        if not call.async_op and call.name != "barrier" and self._inline():
            # the common case, inline: what run_in_order and launch_on would do, without their
            # per-call closures (the group is idle, the caller's stream is current)
            op_id = self.names.add(None, call.seq, call.fingerprint, call.name)
            if call.before is not None:
                call.before()
            self._enqueue(call, None, op_id, SimpleNamespace(cuda_stream=self._last_raw), algorithm)  # (current)
            if call.after is not None:
                call.after()
            return None
        stream = torch.cuda.current_stream(self.ws.device)
        op_id = self.names.add(None, call.seq, call.fingerprint, call.name)
        sync = call._replace(async_op=False, before=staging.on_stream(call.before, stream),
                             after=staging.on_stream(call.after, stream))

        def transfers(ctx) -> None:
            self.launch_on(stream, lambda run: self._enqueue(call, ctx, op_id, run, algorithm))

        run_in_order(sync, self.name, algorithm, staging.on_stream(transfers, stream))
        if call.name == "barrier" and not call.async_op:
            stream.synchronize()  # torch's barrier blocks the CPU
            self.check(call.name)
        if not call.async_op:
            return None
        return self.work_after(stream, call.name, call.result, call.buffers)

    def _start_captured(self, call: Call, algorithm: str):
        """Enqueue ``call`` on the capturing stream, its kernels counting on the device
        (chorus.cuda.capture); not ordered after the group's eager ops on other streams
        (a capture may not wait for work outside it: torch's warm-up sync does that)."""
        import torch

        self.check(call.name)
        stream = torch.cuda.current_stream(self.ws.device)
        op_id = self.names.add(None, call.seq, call.fingerprint, call.name)
        sync = call._replace(async_op=False, before=staging.on_stream(call.before, stream),
                             after=staging.on_stream(call.after, stream))

        def transfers(ctx) -> None:
            self.lanes.graph = True
            try:
                self._enqueue(call, ctx, op_id, stream, algorithm)
            finally:
                self.lanes.graph = False

        run_in_order(sync, self.name, algorithm, staging.on_stream(transfers, stream), captured=True)
        return self.work_after(stream, call.name, call.result, call.buffers) if call.async_op else None

    def all_reduce_now(self, tensor, op, async_op: bool = False):
        """all_reduce of ``tensor`` (a CUDA tensor), now: False if the general path must
        take it (it gives the same result or error); else enqueued on the current stream,
        and True (``async_op``: its CudaWork).  The plan of a (dtype, shape, op) is made
        once (chorus.cuda.plans); per call this checks what a repeated call can change
        (contiguity, device, the group's queue and state), takes the sequence number and
        launches the kernel through the cached launcher (chorus.cuda.launchers.launch),
        or, from the hand-off size, queues NCCL's op and the barrier beside it, as
        _start_nccl does once the group's communicator exists."""
        lanes = self.lanes
        if lanes is None:
            return False
        plan = self._plans.get((tensor.dtype, tensor.shape, op))
        if plan is None:
            plan = cached_plan(self._plans, tensor, op, self._reducible, self._nccl_from, self.pg.size())
        pg, dev, torch_c = self.pg, self._device_index, self._torch._C
        last_stream, stream = self._last_stream, self._last_raw  # (once: p2p from another thread moves them)
        # (_inline's test written out, as check()'s all-clear below: a call each is 0.2-0.5 us of ~5)
        if (not plan or self.broken is not None or not tensor.is_contiguous() or tensor.get_device() != dev
                or pg.queue or recorder.current is not None or torch_c._cuda_getDevice() != dev
                or torch_c._cuda_getCurrentRawStream(dev) != stream or torch_c._cuda_isCurrentStreamCapturing()):
            return False  # (another stream than the group's last op's, or a capture: the general path)
        peers = self._nccl
        handoff = plan.algorithm == "nccl"
        if handoff and (peers is None or not self._nccl_guard or peers.broken is not None):
            return False  # (the group's first hand-off, or the agreement on the CPUs: _start_nccl)
        if not pg.enter_lane():
            return False
        seq, native, log, words, t = pg.take_seq(), None, self._lane_log, self.ws.words, pg.transport
        try:
            if log is not None:
                log.began(seq, plan, op, tensor.shape, async_op)
            if (words[L.TAG_OP] or words[L.STATUS] or t.dead or t.mismatched or t.closed_reason is not None
                    or (peers is not None and peers.broken is not None)):
                self.check("all_reduce")  # (something is wrong somewhere: check() tells whether here)
            if handoff:
                # async (DDP's buckets): the caller's stream goes on (the backward pass
                # computes the next buckets) and waits at wait(), as on ProcessGroupNCCL
                wait = not async_op or plan.average
                op_id = self.names.add(None, seq, plan.fingerprint, "all_reduce")
                native = self._hand_off(op_id, plan.fingerprint, stream,
                                        lambda: peers.all_reduce(tensor, plan.reduce_op, wait), wait)
            else:
                with self.lock:
                    data = tensor.data_ptr()
                    if not lanes.replay_kept(plan, data, data, stream, seq, plan.fingerprint, "all_reduce"):
                        op_id = self.names.add(None, seq, plan.fingerprint, "all_reduce")
                        lanes.begin(op_id, None, stream, plan.dtype, plan.reduce_op, plan.fingerprint)
                        lanes.repeat(plan, data, data, lambda: A.all_reduce(lanes, data, plan.count, plan.item,
                                                                            plan.algorithm))
        except BaseException as exc:
            if log is not None:
                log.failed(seq, exc)
            raise
        finally:
            pg.leave()
        if log is not None:
            log.ring.done = seq
        if plan.average:
            tensor.detach().div_(pg.size())  # AVG (floating dtypes only: see chorus.cuda.plans)
        if not async_op:
            return True
        if native is None or plan.average:
            return self.work_after(last_stream, "all_reduce", [tensor], tensor)
        # NCCL's own Work: wait() is its wait, its future what torch's Work hands out; an
        # event after NCCL's op only if asked for (is_completed, synchronize, a chorus future)
        check = partial(self.check, "all_reduce")
        return CudaWork(partial(self._beside.event_after, native), check, [tensor], (tensor,), native)

    def rows_now(self, name: str, output, input, op, async_op: bool = False):
        """all_gather_into_tensor (``name`` "all_gather") or reduce_scatter_tensor
        ("reduce_scatter") of CUDA tensors, now, as all_reduce_now does: False where the
        general path must take it; else one round of the fused kernel enqueued from a
        cached plan (chorus.cuda.plans.rows_plan), and True (``async_op``: its CudaWork)."""
        lanes, key = self.lanes, (name, input.dtype, output.dtype, input.shape, output.shape, op)
        if lanes is None:
            return False
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= PLANS:
                self._plans.clear()
            plan = self._plans[key] = rows_plan(name, output, input, op, self.pg.size(), self._reducible,
                                                self._nccl_gather_from, lanes.layout.slot) or False
        pg, dev, torch_c = self.pg, self._device_index, self._torch._C
        last_stream, stream = self._last_stream, self._last_raw  # (once: see all_reduce_now)
        if (not plan or self.broken is not None or not input.is_contiguous() or not output.is_contiguous()
                or input.get_device() != dev or output.get_device() != dev
                or pg.queue or recorder.current is not None or torch_c._cuda_getDevice() != dev
                or torch_c._cuda_getCurrentRawStream(dev) != stream or torch_c._cuda_isCurrentStreamCapturing()
                or not pg.enter_lane()):
            return False
        # (all_reduce_now's steps written out: a shared helper taking a closure cost 0.4-0.5 us)
        seq, log, words, t, peers = pg.take_seq(), self._lane_log, self.ws.words, pg.transport, self._nccl
        try:
            if log is not None:
                log.began(seq, plan, op, input.shape, async_op)
            if (words[L.TAG_OP] or words[L.STATUS] or t.dead or t.mismatched or t.closed_reason is not None
                    or (peers is not None and peers.broken is not None)):
                self.check(name)
            with self.lock:
                inp, out = input.data_ptr(), output.data_ptr()
                if not lanes.replay_kept(plan, inp, out, stream, seq, plan.fingerprint, name):
                    op_id = self.names.add(None, seq, plan.fingerprint, name)
                    lanes.begin(op_id, None, stream, plan.dtype, plan.reduce_op, plan.fingerprint)
                    lanes.repeat(plan, inp, out,
                                 lambda: lanes.rows_once(name, inp, out, plan.m, plan.stride, plan.item))
        except BaseException as exc:
            if log is not None:
                log.failed(seq, exc)
            raise
        finally:
            pg.leave()
        if log is not None:
            log.ring.done = seq
        if plan.average:
            output.detach().div_(pg.size())  # AVG (floating dtypes only), as the general path
        return self.work_after(last_stream, name, [output], output) if async_op else True

    def close(self) -> None:
        if self._nccl is not None:
            self._nccl.close()
        if self._beside is not None:
            self._beside.close()
        if self.ws is not None:
            self.pg.transport.remove_failure_listener(self._on_failure)
            self.lanes.close()
            self.ws.close()
            self.ws = self.lanes = None

    # -- calls on NCCL's kernels ----------------------------------------------------------------------
    def _on_nccl(self, call: Call) -> bool:
        """A call NCCL runs: all_reduce from CHORUS_CUDA_NCCL_FROM_BYTES; all_gather and
        reduce_scatter of equal blocks from CHORUS_CUDA_NCCL_GATHER_FROM_BYTES of their whole
        buffer (W blocks); all_to_all (sizes differ by rank: a size could send ranks different
        ways) and broadcast at every size (CHORUS_CUDA_NCCL_ALL_TO_ALL, _BROADCAST); each by
        name (``algorithm="nccl"``) wherever the group hands off.  Every input to the choice
        is the same on every rank of the call."""
        auto = call.algorithm in (None, "auto")
        if call.name == "all_reduce":
            chosen = auto and 0 < self._nccl_from <= call.nbytes
        elif call.name in ("all_gather", "reduce_scatter") and call.uniform:
            chosen = auto and 0 < self._nccl_gather_from <= call.nbytes * self.pg.size()
        elif call.name == "all_to_all":
            chosen = auto and self._nccl_exchange
        elif call.name == "broadcast":
            chosen = auto and self._nccl_broadcast
        else:
            return False
        by_name = call.algorithm == "nccl" and self._handoff
        return bool((chosen or by_name) and (not call.reduce_op
                                             or nccl_reduces(staging.torch_dtype_name(_first(call)), call.reduce_op)))

    def _start_nccl(self, call: Call):
        """The call on the group's NCCL communicator (chorus.cuda.nccl), in issue order
        with the group's other ops: the ops compared first (a barrier on the GPUs, _guard,
        or on the CPUs: CHORUS_CUDA_NCCL_AGREE; a capture always on the CPUs), then NCCL's
        kernel ordered after the current stream, which waits for it."""
        import torch

        self.check(call.name)
        peers = self._nccl
        guard = self._nccl_guard and not capture.capturing()
        if guard and peers is not None and self._inline():
            # the common case, inline, as start()'s (a hundred microseconds of closures and hooks less)
            op_id = self.names.add(None, call.seq, call.fingerprint, call.name)
            if call.before is not None:
                call.before()
            self._hand_off(op_id, call.fingerprint, self._last_raw, lambda: peers.run(call))
            if call.after is not None:
                call.after()
            if not call.async_op:
                return None
            return self.work_after(self._last_stream, call.name, call.result, call.buffers)
        stream = torch.cuda.current_stream(self.ws.device)
        if not capture.capturing():  # (a capture may not wait for work outside it)
            self._follow(stream)
        sync = call._replace(async_op=False, before=staging.on_stream(call.before, stream),
                             after=staging.on_stream(call.after, stream))
        op_id = self.names.add(None, call.seq, call.fingerprint, call.name) if guard else 0

        def transfers(ctx) -> None:
            nonlocal peers
            if guard:  # chorus's barrier, on the GPUs, compares the ops (beside NCCL's kernel)
                self.launch_on(stream, lambda run: self._guard(ctx, op_id, run.cuda_stream, call.fingerprint))
                if peers is None:
                    # The group's first hand-off: making the communicator below waits for every
                    # rank (a handshake, the store, NCCL's init), and a rank whose op took chorus's
                    # kernels would never come.  So the CPU waits for the barrier first (once per
                    # group): every rank is at this op, or the check raises what the barrier found.
                    self._beside.synchronize()
                    self.check(call.name)
            if peers is None:
                peers = self._nccl = self._make_peers()
            if guard:
                peers.watch(self.ws.words, L.STATUS)
            else:  # (a capture agrees now, once: its replays run only NCCL's kernel)
                peers.agree(call)
            peers.run(call)

        run_in_order(sync, self.name, "nccl", staging.on_stream(transfers, stream))
        if not call.async_op:
            return None
        return self.work_after(stream, call.name, call.result, call.buffers)

    def _make_peers(self) -> NcclPeers:
        return group_peers(self.pg)  # (collective: every rank at the same op)

    def _hand_off(self, op_id: int, fprint: int, raw: int, nccl_op, wait: bool = True):
        """``nccl_op()`` (queues NCCL's op after the work of the caller's stream ``raw``;
        torch's Work of it) first, then the barrier beside it (_guard) after that same
        work: its launch does not delay NCCL's.  ``wait``: whether the caller's stream
        waits for NCCL's op."""
        self._nccl.watch(self.ws.words, L.STATUS)  # (once: a capture may have made the communicator)
        (self._beside or self._side()).mark(raw)  # (made once: no lock per call)
        native = None
        try:
            native = nccl_op()
        finally:  # (NCCL refused the op: the barrier still keeps this rank's epochs in step)
            self._guard(None, op_id, None, fprint, None if wait else native)
        return native

    def _side(self) -> Beside:
        """The stream beside the caller's (made at the group's first hand-off)."""
        with self.lock:
            if self._beside is None:
                self._beside = Beside(self.ws.device)
            return self._beside

    def _guard(self, ctx, op_id: int, raw: int | None, fprint: int, running=None) -> None:
        """One barrier of the group's workspace carrying ``fprint``, beside the hand-off on
        stream ``raw`` (queued next; None: since Beside.mark): a rank whose op differs (by
        NCCL or by chorus's kernels) is found there, the group breaks (STATUS;
        NcclPeers.watch aborts the communicator, so NCCL's kernel stops waiting), and the
        op and every later one raise CollectiveMismatchError naming both calls.
        ``running``: torch's Work of NCCL's op where the caller's stream does not wait for
        it: the group's next op on chorus's kernels runs after it (Lanes.unjoined), as ops
        of one ProcessGroupNCCL do; hand-offs in a row need nothing (NCCL orders one
        communicator's launches, whatever their streams), so none waits for it here."""
        beside = self._side()
        with self.lock:
            lanes = self.lanes
            lanes.begin(op_id, ctx, beside.follow(raw), "", "", fprint, joins=False)
            try:
                lanes.barrier()
            finally:  # (the group's next op follows this barrier whatever its launch raised)
                lanes.follow = beside.end()
                if running is not None:
                    lanes.unjoined = partial(beside.joined, running)

    # -- point-to-point ------------------------------------------------------------------------------
    def p2p(self, kind: str, tensor, peer: int, tag: int, async_op: bool):
        """Send ``tensor`` to (kind "send") or receive it from ("recv") group rank ``peer``;
        sends and receives of a pair match in issue order, and the tags must agree."""
        return p2p.batch(self, [(kind, tensor, peer, tag)], async_op)

    def p2p_batch(self, ops, async_op: bool):
        """Several sends and receives ((kind, tensor, peer, tag) each) at once (chorus.cuda.p2p)."""
        return p2p.batch(self, ops, async_op)

    # -- failures ------------------------------------------------------------------------------------
    def check(self, what: str) -> None:
        """Raise the group's error, if it has one (see the module docstring)."""
        if self.broken is not None:
            raise self.broken
        if self._nccl is not None and self._nccl.broken is not None:
            self.broken = self._nccl.broken
            raise self.broken
        if self.ws is None:
            return
        words = self.ws.words
        if words[L.TAG_OP]:
            raise failures.tag_mismatch(self.pg, self.names, words)
        t = self.pg.transport  # (nothing wrong in it at all: failure() is None, known without the call)
        if not words[L.STATUS] and (not (t.dead or t.mismatched or t.closed_reason is not None)
                                    or t.failure(self.pg.id, None) is None):
            return
        self.broken = failures.error(self.pg, self.names, what, words)
        words[L.ABORT] = 1  # the rest of the queue fails fast
        if self._nccl is not None:
            self._nccl.abort_soon()  # (NCCL's kernels queued behind a failed barrier)
        raise self.broken

    def _on_failure(self, group: int, why: str) -> None:
        ws = self.ws
        if ws is None:
            return
        dead = self.pg.transport.dead
        if group == self.pg.id or (group == -1 and any(m in dead for m in self.pg.members)):
            ws.words[L.ABORT] = 1

    # -- helpers -------------------------------------------------------------------------------------
    def _inline(self, raw: int | None = None) -> bool:
        """Whether an op may be enqueued inline, without run_in_order's per-call closures:
        the group idle (nothing queued, no recorder listener), and the device and stream
        of the group's last op (``raw``: as read by the caller) current."""
        torch_c = self._torch._C
        return (not self.pg.queue and recorder.current is None
                and torch_c._cuda_getDevice() == self._device_index
                and torch_c._cuda_getCurrentRawStream(self._device_index)
                == (self._last_raw if raw is None else raw))

    def launch_on(self, stream, enqueue) -> None:
        """``enqueue(run)`` puts an op's work on the caller's stream ``stream`` (``run``):
        after the work queued there and before the work queued there later, with that
        stream's device current."""
        import torch

        self._follow(stream)
        if torch.cuda.current_device() == stream.device.index:
            enqueue(stream)
            return
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            enqueue(stream)

    def _follow(self, stream) -> None:
        """Ops of a group must run on the GPU in issue order (the barrier epochs and slot
        parities rely on it), as on ProcessGroupNCCL's one stream per communicator: an op
        issued on another stream than the group's last op makes that stream wait for the
        last op first (FSDP2 issues all-gathers and reduce-scatters on streams of their
        own).  On the same stream, as in the common case, nothing is added."""
        raw = stream.cuda_stream
        if self._last_stream is not None and raw != self._last_raw:
            stream.wait_stream(self._last_stream)
        self._last_stream, self._last_raw = stream, raw

    def work_after(self, stream, what: str, result, keep):
        """The CudaWork of op ``what``, just enqueued on ``stream``: an event recorded after
        it; ``result`` what its future gives, ``keep`` what it holds alive until done."""
        import torch

        event = torch.cuda.Event()
        event.record(stream)
        return CudaWork(event, lambda: self.check(what), result, (keep,))

    def _enqueue(self, call: Call, ctx, op_id: int, stream, algorithm: str = "") -> None:
        first = _first(call)
        dtype = staging.torch_dtype_name(first) if first is not None else ""
        item = first.element_size() if first is not None else 1
        with self.lock:
            self.lanes.begin(op_id, ctx, stream.cuda_stream, dtype, call.reduce_op, call.fingerprint)
            A.enqueue(self.lanes, call, item, algorithm)


def _first(call: Call):
    return next((t for t in call.buffers.values() if hasattr(t, "is_cuda")), None)
