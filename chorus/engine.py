"""Runs one rank's schedule over a transport.

For each step the engine posts every receive first, then every send, then does the local
copies, and waits for all of them with the op's deadline.  Every collective frame
carries the op's sequence number and fingerprint; a receive that brings another op's
frame raises :class:`CollectiveMismatchError` instead of mixing data.

A recorder (``engine.recorder``), when attached, is told when an op begins and ends and
about every transfer; with none attached the cost is one attribute test per op.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from chorus.errors import CollectiveMismatchError
from chorus.schedules.base import Copy, Recv, Region, Schedule, Send
from chorus.transport.base import Transport
from chorus.transport.handles import Handle
from chorus.wire.frames import Kind


@dataclass(frozen=True, slots=True)
class OpContext:
    """What identifies one collective call on the wire and in errors."""

    name: str  # "barrier", "all_reduce", ...
    group: int  # group id
    seq: int  # the group's sequence number of this op
    fingerprint: int  # hash of (op, dtype, count, root, reduce op)
    members: tuple[int, ...]  # group rank -> global rank
    deadline: float | None  # time.monotonic() deadline

    def describe(self) -> str:
        return f"{self.name} (seq {self.seq}) on group {self.group}"


recorder: Callable[[str, OpContext, dict], None] | None = None


def region_bytes(buffers: dict[str, np.ndarray], region: Region) -> memoryview:
    arr = buffers[region.buffer][region.offset: region.offset + region.count]
    return memoryview(arr.view(np.uint8))


def run_schedule(schedule: Schedule, buffers: dict[str, np.ndarray], transport: Transport,
                 ctx: OpContext, dtype: int = 0) -> None:
    """Execute ``schedule`` for this rank.  ``buffers`` maps region names to flat arrays."""
    if recorder is not None:
        recorder("begin", ctx, {"steps": len(schedule)})
    started = time.perf_counter()
    for step in schedule:
        handles: list[Handle] = []
        recvs: list[Handle] = []
        for op in step:
            if isinstance(op, Recv):
                h = transport.irecv(ctx.members[op.peer], region_bytes(buffers, op.dst),
                                    kind=Kind.COLL, group=ctx.group, tag=op.tag, dtype=dtype)
                recvs.append(h)
                handles.append(h)
        for op in step:
            if isinstance(op, Send):
                handles.append(transport.isend(ctx.members[op.peer], region_bytes(buffers, op.src),
                                               kind=Kind.COLL, group=ctx.group, tag=op.tag, seq=ctx.seq,
                                               dtype=dtype, fingerprint=ctx.fingerprint))
            elif isinstance(op, Copy):
                region_bytes(buffers, op.dst)[:] = region_bytes(buffers, op.src)
        transport.wait_all(handles, ctx.deadline, ctx.describe)
        for h in recvs:
            _check_same_op(h, ctx)
    if recorder is not None:
        recorder("end", ctx, {"seconds": time.perf_counter() - started})


def _check_same_op(h: Handle, ctx: OpContext) -> None:
    got = h.header
    if got.seq != ctx.seq or got.fingerprint != ctx.fingerprint:
        raise CollectiveMismatchError(
            f"{ctx.describe()}: rank {h.peer} sent a message of a different collective "
            f"(its seq {got.seq}, fingerprint {got.fingerprint:#x}; ours {ctx.seq}, "
            f"{ctx.fingerprint:#x}). Every rank of the group must call the same collectives "
            "in the same order with the same arguments."
        )
