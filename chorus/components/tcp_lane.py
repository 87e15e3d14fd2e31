"""The TCP latency lane: a synchronous all_reduce of a small numpy array (or of a torch
CPU tensor, through a numpy view) on a group whose collectives run as schedules over the
transport (no shared-memory window: ranks on several hosts, ``CHORUS_TRANSPORT=tcp``),
from a plan cached per (dtype, shape, op).

On such a group a small all_reduce is a few small messages, and the general path (the
Call, selection, ``run_in_order``, the engine's walk over the schedule's regions and
temporaries) costs several times what its messages cost.  A plan is the schedule the
schedules component would run for the call (``ScheduleComponent.default`` and
``.schedule``: the same algorithm, so the same bits on every rank), compiled once into
what each step posts: the receives (peer, tag, a view of the plan's buffers, the
reduction that completes it), the sends and the local copies, and whether its one
receive is read after the sends (``Transport.reads_now``).  A call copies the array
into the plan's buffer, runs the steps and copies the result back.

The lane keeps the general path's guarantees because it moves the same frames through
the same primitives: ``Transport.exchange_now`` (a step that swaps with one peer),
``send_now``/``recv_now`` (``irecv`` where a step
receives several messages, or one the transport would not read at once) and
``wait_all``, with the op's sequence number and fingerprint, so a peer that called
something else raises CollectiveMismatchError (settled as ``run_in_order`` settles it,
to name every rank's call), a lost peer PeerLostError, a silent one CommTimeoutError at
the group's timeout, and a rank on the lane and a rank on the general path work
together.  It takes the group's next sequence number and tells the transport when the op
finished, so lane and general calls interleave.  It steps aside (returns False) whenever
the general path is needed: a recorder listener attached, async ops queued, another
thread inside one of the group's collectives (the general path raises
ConcurrentCallError), a call the plan does not cover (PREMUL_SUM, a non-contiguous
array, more than ``CHORUS_TCP_LANE_BYTES``).  Ops are noted in the group's flight
recorder as the shared-memory lanes note theirs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import numpy as np

from chorus import config
from chorus.components.base import settled
from chorus.components.lane import ReduceLane
from chorus.debug import flight
from chorus.engine import OpContext, combine_first
from chorus.errors import InvalidArgumentError
from chorus.reductions import combiner
from chorus.schedules.base import Copy, Recv, Send
from chorus.wire.dtypes import DTYPE_CODES
from chorus.wire.fingerprint import fingerprint
from chorus.wire.frames import Kind

COLL = int(Kind.COLL)


class Plan:
    """One all_reduce of one (dtype, shape, op) on one group, compiled: ``data`` (the plan's
    copy of the array, of its shape), ``steps`` (per step: the receives as (peer, tag, view,
    finish), the sends as (peer, tag, view), the copies as callables, whether its one
    receive is read by ``recv_now`` after the sends, and, for an exchange with one peer,
    (peer, send tag, send view, receive tag, receive view, finish, the copies that come
    first: a step before it that only copied); peers are global ranks), the wire
    dtype code, the fingerprint, whether the result is divided by W (AVG), and the dtype
    name that division takes.  ``component`` and ``algorithm`` name it in
    the flight recorder."""

    __slots__ = ("data", "steps", "code", "fingerprint", "average", "dtype", "algorithm")
    component = "tcp"

    def __init__(self, data: np.ndarray, steps: tuple, code: int, fingerprint: int, average: bool,
                 dtype: str, algorithm: str):
        self.data = data
        self.steps = steps
        self.code = code
        self.fingerprint = fingerprint
        self.average = average
        self.dtype = dtype
        self.algorithm = algorithm


def compile_schedule(schedule, members: tuple[int, ...], data: np.ndarray, combine,
                     reads_now: Callable[[int, int], bool]) -> tuple:
    """The steps of ``schedule`` (one rank's all_reduce, its ``data`` region in ``data``)
    as Plan.steps, on buffers made here: its scratch, and the temporaries its reducing
    receives land in before ``combine(dst, temp)`` folds them in (as chorus.engine does).
    ``reads_now(peer, nbytes)``: whether the transport reads a step's one receive in the
    calling thread after its sends (``Transport.reads_now``)."""
    widest = max((sum(op.dst.count for op in step if isinstance(op, Recv) and op.reduce) for step in schedule),
                 default=0)
    buffers = {"data": data, "scratch": np.empty(schedule.scratch, data.dtype)}
    temps = np.empty(widest, data.dtype)

    def region(r) -> np.ndarray:
        return buffers[r.buffer][r.offset: r.offset + r.count]

    def raw(r) -> memoryview:
        return memoryview(region(r).view(np.uint8))

    steps = []
    for step in schedule:
        recvs, sends, copies, offset = [], [], [], 0
        for op in step:
            if isinstance(op, Recv):
                if op.reduce:
                    temp = temps[offset: offset + op.dst.count]
                    offset += op.dst.count
                    combined = (partial(combine_first, combine, region(op.dst), temp) if op.first
                                else partial(combine, region(op.dst), temp))
                    recvs.append((members[op.peer], op.tag, memoryview(temp.view(np.uint8)), combined))
                else:
                    recvs.append((members[op.peer], op.tag, raw(op.dst), None))
            elif isinstance(op, Send):
                sends.append((members[op.peer], op.tag, raw(op.src)))
            elif isinstance(op, Copy):
                dst, src = region(op.dst), region(op.src)
                # (dst[...] = src: np.copyto's result for one dtype, without its Python-level call)
                copies.append(partial(combine, dst, src) if op.reduce else partial(dst.__setitem__, Ellipsis, src))
        lone = len(recvs) == 1 and reads_now(recvs[0][0], len(recvs[0][2]))
        # A lone receive from the peer of the step's one send, with no local copy to order
        # against either, is an exchange (Transport.exchange_now).
        pair = (sends[0][0], sends[0][1], sends[0][2], recvs[0][1], recvs[0][2], recvs[0][3]) if (
            lone and len(sends) == 1 and not copies and sends[0][0] == recvs[0][0]) else None
        if pair is not None:
            # A step before it that only copies (recursive doubling's snapshot of what it
            # sends) runs as the exchange's first part: the same order, one step fewer.
            before = steps.pop()[2] if steps and not steps[-1][0] and not steps[-1][1] else ()
            pair += (before,)
        steps.append((tuple(recvs), tuple(sends), tuple(copies), lone, pair))
    return tuple(steps)


class TcpLane(ReduceLane):
    """The latency lane of group ``pg``, whose collectives ``schedules`` (its
    ScheduleComponent) runs: the API tries ``all_reduce_now`` first (see the module
    docstring)."""

    def __init__(self, pg, schedules):
        self.schedules = schedules
        self.limit = config.get("CHORUS_TCP_LANE_BYTES")
        self.flight = ring = flight.attach(pg)
        self._lane_init(pg, *(ring.lanes[0], ring.keys[0]) if ring is not None else (None, None))

    def all_to_all_now(self, out, inp) -> bool:
        """No all_to_all lane over TCP: the general path runs it."""
        return False

    def _reduce_run(self, seq: int, plan: Plan, arr: np.ndarray) -> None:
        """Run ``plan`` as op ``seq`` of the group on ``arr`` (the caller's array)."""
        pg = self.pg
        t, group, code, fp = pg.transport, pg.id, plan.code, plan.fingerprint
        deadline = time.monotonic() + pg.timeout
        ctx = None  # the op's OpContext, made only where a wait or an error names the op
        try:
            data = plan.data
            data[...] = arr  # (the same shape: no reshape either way)
            expect = (seq, fp)
            for recvs, sends, copies, lone, pair in plan.steps:
                if pair is not None:
                    peer, send_tag, out, recv_tag, into, finish, before = pair
                    for copy in before:
                        copy()
                    handles = t.exchange_now(peer, out, into, COLL, group, send_tag, recv_tag, seq, code, fp, finish,
                                             deadline)
                    if handles:
                        ctx = ctx or OpContext("all_reduce", group, seq, fp, pg.members, deadline)
                        t.wait_all(handles, deadline, ctx.describe, label=ctx.label)
                    continue
                # A step of one small receive sends first and then reads for it, posting
                # nothing it need not (Transport.send_now/recv_now).  Other steps post their
                # receives first: several are read side by side by the reader threads, and a
                # large one lands as it comes (two ranks that both sent first more than their
                # sockets hold would each stall a write slice, SEND_SLICE_S).
                handles = [] if lone else [
                    t.irecv(peer, view, kind=COLL, group=group, tag=tag, dtype=code, expect=expect,
                            finish=finish, waited=True) for peer, tag, view, finish in recvs]
                for peer, tag, view in sends:
                    h = t.send_now(peer, view, COLL, group, tag, seq, code, fp)
                    if h is not None:
                        handles.append(h)
                for copy in copies:
                    copy()
                if lone:
                    peer, tag, view, finish = recvs[0]
                    h = t.recv_now(peer, view, COLL, group, tag, code, expect, finish, deadline)
                    if h is not None:
                        handles.insert(0, h)
                if handles:
                    ctx = ctx or OpContext("all_reduce", group, seq, fp, pg.members, deadline)
                    t.wait_all(handles, deadline, ctx.describe, label=ctx.label)
            t.finished(group, seq, fp)
            arr[...] = data
        except BaseException as exc:
            error = settled(pg, exc, ctx or OpContext("all_reduce", group, seq, fp, pg.members, deadline))
            if error is exc:
                raise
            raise error from None

    def _reduce_plan(self, arr: np.ndarray, op):
        """The cached Plan for ``arr``'s dtype and shape and ``op``, or False."""
        buf = self._plan_start(arr, op)
        if buf is None or op.name == "PREMUL_SUM" or arr.nbytes > self.limit or buf.copied or buf.dtype == "bfloat16":
            return False
        pg = self.pg
        try:
            algorithm = self.schedules.default("all_reduce", pg.size(), buf.nbytes)
        except InvalidArgumentError:
            return False  # (a CHORUS_ALGO_ALL_REDUCE the general path rejects)
        count = buf.numel
        schedule = self.schedules.schedule(pg, "all_reduce", algorithm, {"count": count}, -1, arr.itemsize)
        data = np.empty(arr.shape, arr.dtype)
        steps = compile_schedule(schedule, pg.members, data.reshape(-1), combiner(op, buf.dtype),
                                 pg.transport.reads_now)
        plan = Plan(data, steps, DTYPE_CODES[buf.dtype], fingerprint("all_reduce", buf.dtype, count, -1, op.name),
                    op.name == "AVG", buf.dtype, algorithm)
        self.plans[(arr.dtype, arr.shape, op.name)] = plan
        return plan
