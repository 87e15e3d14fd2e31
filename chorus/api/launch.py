"""What every collective call shares: resolve the group, check tensors, take a sequence
number, build the schedule, and run it in order (inline, or on the worker for async_op)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from chorus import engine
from chorus.api.groups import resolve, warn_not_in_group
from chorus.buffers import Buffer, as_buffer
from chorus.engine import Combine
from chorus.errors import InvalidArgumentError
from chorus.process_group import ProcessGroup
from chorus.reductions import row_reducer
from chorus.schedules.registry import schedule as build_schedule
from chorus.selection import choose, without_hierarchy
from chorus.wire.dtypes import DTYPE_CODES
from chorus.wire.fingerprint import fingerprint
from chorus.work import CompletedWork, QueuedWork, Work

SEGMENT_BYTES = int(os.environ.get("CHORUS_SEGMENT_BYTES", 1 << 20))  # pipelining unit (ring, chain)


def member_group(group: Any, op: str) -> ProcessGroup | None:
    """The group to run on, or None (after a warning) when this rank is not a member."""
    pg = resolve(group, op)
    if pg is None:
        warn_not_in_group(op)
    return pg


def not_member(async_op: bool) -> Work | None:
    return CompletedWork() if async_op else None


def writable(tensor: Any, op: str, what: str = "tensor") -> Buffer:
    buf = as_buffer(tensor, op=op, what=what)
    if not buf.array.flags.writeable:
        raise InvalidArgumentError(f"{op}: {what} is read-only; pass a writable array")
    return buf


def same_dtype(bufs: list[Buffer], op: str, what: str) -> str:
    dtypes = {b.dtype for b in bufs}
    if len(dtypes) > 1:
        raise InvalidArgumentError(f"{op}: all {what} must have one dtype, got {sorted(dtypes)}")
    return bufs[0].dtype


def root_rank(pg: ProcessGroup, root: int | None, group_root: int | None, op: str, name: str) -> int:
    """Validate ``src``/``dst`` (global) or ``group_src``/``group_dst``; return the group rank."""
    if root is not None and group_root is not None:
        raise InvalidArgumentError(f"{op}: pass either {name}= or group_{name}=, not both")
    if group_root is not None:
        pg.global_rank(group_root, op=op, what=f"group_{name}")
        return group_root
    return pg.group_rank(0 if root is None else root, op=op, what=name)


def run(pg: ProcessGroup, name: str, *, dtype: str, count: int, buffers: dict[str, np.ndarray],
        async_op: bool, algorithm: str | None, nbytes: int, root: int = -1, reduce_op: str = "",
        combine: Combine | None = None, before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None, result: list | None = None, uniform: bool = True,
        args: dict[str, Any] | None = None) -> Work | None:
    """Issue collective ``name`` on ``pg``: everything here runs now, in issue order; the
    transfers run inline (synchronous, idle group) or on the group's worker (async_op).

    ``args`` are the schedule's size arguments (``count``, ``counts``, ...); ``root`` is
    passed to rooted schedules and, like dtype/count/op, goes into the fingerprint.

    A group whose members share this host has a shared-memory window (``pg.shm``, see
    chorus.shm); its collectives run there unless ``algorithm=`` or ``CHORUS_ALGO_<NAME>``
    asks for a TCP algorithm (``CHORUS_TRANSPORT=tcp`` disables shared memory).
    """
    hierarchy = pg.hierarchy  # a group spanning hosts: chorus.api.hierarchy
    if hierarchy is not None and hierarchy.takes(name, algorithm):
        return hierarchy.run(name, dtype=dtype, count=count, buffers=buffers, async_op=async_op, root=root,
                             reduce_op=reduce_op, combine=combine, before=before, after=after,
                             result=result, args=args)
    if algorithm is not None:
        algorithm = without_hierarchy(name, algorithm)
    shm = pg.shm
    if shm is not None and algorithm is None and name not in shm.tcp_only:
        return _run_shm(pg, shm, name, dtype, count, buffers, async_op, root, reduce_op, before,
                        after, result, args)
    algo = choose(name, pg.size(), nbytes, algorithm, uniform)
    schedule_args = dict(args or {})
    if root >= 0:
        schedule_args["root"] = root
    itemsize = max(1, next(iter(buffers.values())).itemsize) if buffers else 1
    if algo in ("ring", "chain") and name in ("all_reduce", "broadcast"):
        schedule_args["segment"] = max(1, SEGMENT_BYTES // itemsize)
    sched = build_schedule(name, algo, pg.rank(), pg.size(), **schedule_args)
    ctx = pg.next_context(name, fingerprint(name, dtype, count, root, reduce_op))
    code = DTYPE_CODES[dtype]

    def body() -> list | None:
        if before is not None:
            before()
        if shm is not None:
            shm.announce_tcp(ctx)
        pg.run_schedule(sched, buffers, ctx, code, combine)
        if after is not None:
            after()
        return result

    out = pg.submit(body, async_op)
    return QueuedWork(out, result) if async_op else None



def _run_shm(pg: ProcessGroup, shm, name: str, dtype: str, count: int, buffers: dict[str, np.ndarray],
             async_op: bool, root: int, reduce_op: str, before, after, result, args) -> Work | None:
    """``run`` for a group with a shared-memory window (chorus.shm): same order, hooks,
    fingerprints and Work as the TCP path; no algorithm to choose, no schedule to build."""
    ctx = pg.next_context(name, fingerprint(name, dtype, count, root, reduce_op))
    reduce = row_reducer(reduce_op, dtype) if reduce_op else None
    return issue(pg, ctx, {"transport": "shm"}, lambda: shm.run(name, ctx, buffers, reduce, root, args),
                 before, after, result, async_op)


def issue(pg: ProcessGroup, ctx, detail: dict, op: Callable[[], None], before, after, result: list | None,
          async_op: bool) -> Work | None:
    """Run ``op`` (the transfers of collective ``ctx``) in issue order between the
    collective's ``before``/``after`` hooks, telling the recorder (with ``detail``) when it
    begins and ends: inline, or on the group's worker for ``async_op``."""

    def body() -> list | None:
        if before is not None:
            before()
        if engine.recorder is not None:
            engine.recorder("begin", ctx, detail)
        op()
        if engine.recorder is not None:
            engine.recorder("end", ctx, {"transport": detail["transport"]})
        if after is not None:
            after()
        return result

    out = pg.submit(body, async_op)
    return QueuedWork(out, result) if async_op else None
