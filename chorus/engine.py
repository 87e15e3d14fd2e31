"""Runs one rank's schedule over a transport.

For each step the engine posts every receive first, then every send, then does the local
copies, and waits for all of them with the op's deadline.  Every collective frame
carries the op's sequence number and fingerprint; a receive that brings another op's
frame raises :class:`CollectiveMismatchError` instead of mixing data.

With a recorder listener attached (chorus.recorder), every send and receive of a step is
reported when the step's wait ends; with none attached the cost is one attribute test per
op.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import numpy as np

from chorus import recorder
from chorus.schedules.base import Copy, Recv, Region, Schedule, Send
from chorus.transport.base import Transport
from chorus.transport.handles import Handle
from chorus.wire.frames import Kind


class OpContext:
    """What identifies one collective call on the wire and in errors.

    A plain slots class (not a frozen dataclass): one is built per op, and on the
    shared-memory fast path its construction is a visible share of a small all_reduce.
    Treat it as read-only.
    """

    __slots__ = ("name", "group", "seq", "fingerprint", "members", "deadline")

    def __init__(self, name: str, group: int, seq: int, fingerprint: int, members: tuple[int, ...],
                 deadline: float | None):
        self.name = name  # "barrier", "all_reduce", ...
        self.group = group  # group id
        self.seq = seq  # the group's sequence number of this op
        self.fingerprint = fingerprint  # hash of (op, dtype, count, root, reduce op)
        self.members = members  # group rank -> global rank
        self.deadline = deadline  # time.monotonic() deadline

    def __repr__(self) -> str:
        return f"OpContext({self.name!r}, group={self.group}, seq={self.seq}, fingerprint={self.fingerprint:#x})"

    def describe(self) -> str:
        return f"{self.name} (seq {self.seq}) on group {self.group}"

    def label(self) -> str:
        """The op as waiting reports name it: "all_reduce #6"."""
        return f"{self.name} #{self.seq}"


Combine = Callable[[np.ndarray, np.ndarray], None]


class Workspace:
    """Memory a group reuses across ops (scratch and receive temporaries), so large
    collectives do not pay fresh page faults on every call."""

    def __init__(self) -> None:
        self._mem = np.empty(0, np.uint8)

    def take(self, nbytes: int) -> np.ndarray:
        if self._mem.nbytes < nbytes:
            self._mem = np.empty(max(nbytes, 2 * self._mem.nbytes), np.uint8)
        return self._mem[:nbytes]


def combine_first(combine: Combine, dst: np.ndarray, received: np.ndarray) -> None:
    """``dst = op(received, dst)`` with ``combine(a, b)`` computing ``a = op(a, b)``: a
    reducing receive whose data is the left operand (``Recv.first``)."""
    combine(received, dst)
    dst[...] = received


def _region(buffers: dict[str, np.ndarray], region: Region) -> np.ndarray:
    return buffers[region.buffer][region.offset: region.offset + region.count]


def region_bytes(buffers: dict[str, np.ndarray], region: Region) -> memoryview:
    return memoryview(_region(buffers, region).view(np.uint8))


def run_schedule(schedule: Schedule, buffers: dict[str, np.ndarray], transport: Transport,
                 ctx: OpContext, dtype: int = 0, combine: Combine | None = None,
                 workspace: Workspace | None = None, algorithm: str = "", channel: int | None = None) -> None:
    """Execute ``schedule`` for this rank.

    ``buffers`` maps region names to flat arrays of one dtype (``dtype`` is its wire code);
    ``combine(dst, src)`` reduces for ``Recv(reduce=True)``.  Per step: post every receive
    (reducing ones into temporaries, combined by the thread that completes them as soon as
    each segment has arrived), then every send, do the copies, and wait once.  ``channel``:
    the part of a split op this is (chorus.components.channels), told to the recorder.
    """
    element = next((b.dtype for b in buffers.values()), np.dtype(np.uint8))
    temps = _temporaries(schedule, element, workspace or Workspace())
    if schedule.scratch:
        buffers = {**buffers, "scratch": temps.pop()}
    expect = (ctx.seq, ctx.fingerprint)
    for step in schedule:
        started = time.perf_counter() if recorder.current is not None else 0.0
        handles: list[Handle] = []
        offset = 0
        for op in step:
            if isinstance(op, Recv):
                finish = None
                if op.reduce:  # receive into a temporary; the completing thread combines it
                    temp = temps[0][offset: offset + op.dst.count]
                    offset += op.dst.count
                    view = memoryview(temp.view(np.uint8))
                    dst = _region(buffers, op.dst)
                    finish = partial(combine_first, combine, dst, temp) if op.first else partial(combine, dst, temp)
                else:
                    view = region_bytes(buffers, op.dst)
                handles.append(transport.irecv(ctx.members[op.peer], view, kind=Kind.COLL, group=ctx.group,
                                               tag=op.tag, dtype=dtype, expect=expect, finish=finish,
                                               waited=True))
        for op in step:
            if isinstance(op, Send):
                # sync: written by this thread.  Safe because every receive of the step is
                # already posted and peers' reader threads always drain their sockets.
                handles.append(transport.isend(ctx.members[op.peer], region_bytes(buffers, op.src),
                                               kind=Kind.COLL, group=ctx.group, tag=op.tag, seq=ctx.seq,
                                               dtype=dtype, fingerprint=ctx.fingerprint, sync=True))
            elif isinstance(op, Copy):
                if op.reduce:
                    combine(_region(buffers, op.dst), _region(buffers, op.src))
                else:
                    _region(buffers, op.dst)[...] = _region(buffers, op.src)
        transport.wait_all(handles, ctx.deadline, ctx.describe, label=ctx.label)
        if started:
            _report(step, ctx, buffers, started, algorithm, channel)
    transport.finished(ctx.group, ctx.seq, ctx.fingerprint)


def _report(step, ctx: OpContext, buffers: dict[str, np.ndarray], started: float, algorithm: str,
            channel: int | None) -> None:
    """Tell the recorder about the step's transfers (each spans the step's wait)."""
    detail = {} if channel is None else {"channel": channel}
    for op in step:
        if isinstance(op, (Send, Recv)):
            region = op.src if isinstance(op, Send) else op.dst
            nbytes = region.count * buffers[region.buffer].itemsize if region.buffer in buffers else 0
            recorder.transfer("send" if isinstance(op, Send) else "recv", ctx, "tcp", started, nbytes,
                              ctx.members[op.peer], algorithm, **detail)


def _temporaries(schedule: Schedule, element: np.dtype, workspace: Workspace) -> list[np.ndarray]:
    """[receive temporaries for the widest reducing step] (+ [scratch] when declared)."""
    widest = max((sum(op.dst.count for op in step if isinstance(op, Recv) and op.reduce)
                  for step in schedule), default=0)
    total = widest + schedule.scratch
    mem = workspace.take(total * element.itemsize).view(element) if total else np.empty(0, element)
    out = [mem[:widest]]
    if schedule.scratch:
        out.append(mem[widest:total])
    return out
