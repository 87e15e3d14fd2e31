"""Collectives.  Each validates its arguments, takes the group's next sequence number and
runs a schedule through the group's op queue (inline when synchronous and idle)."""

from __future__ import annotations

import numpy as np

from chorus.api.groups import resolve, warn_not_in_group
from chorus.schedules.barrier import dissemination_barrier
from chorus.wire.fingerprint import fingerprint
from chorus.work import CompletedWork, QueuedWork, Work

_TOKEN = {"token": np.zeros(0, np.uint8)}
_BARRIER_FP = fingerprint("barrier")


def barrier(group=None, async_op: bool = False, device_ids=None) -> Work | None:
    """Block until every rank of ``group`` has called barrier (dissemination over the
    transport, ceil(log2 W) rounds of empty messages)."""
    pg = resolve(group, "barrier")
    if pg is None:
        warn_not_in_group("barrier")
        return CompletedWork() if async_op else None
    ctx = pg.next_context("barrier", _BARRIER_FP)
    schedule = dissemination_barrier(pg.rank(), pg.size())
    result = pg.submit(lambda: pg.run_schedule(schedule, _TOKEN, ctx), async_op)
    return QueuedWork(result) if async_op else None
