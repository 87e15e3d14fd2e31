"""Which CPUs a group's ranks may run on, together: what decides whether a waiting rank
polls (chorus.shm.group.backoff_for).

Each rank knows only its own CPU affinity.  A rank pinned to one CPU (``taskset``,
``numactl``, a launcher that binds each rank to a core) sees one usable CPU, yet it has
that CPU to itself: judged alone it would count the host as oversubscribed and never
poll.  So at group creation every member sends its affinity, as a bit mask of CPUs
0..1023, and its cgroup CPU quota; group rank 0 combines them (``combine``) into

    cpus      the CPUs in any member's mask, at most the smallest quota
    disjoint  True if no two members' masks share a CPU (each rank has CPUs of its own)

and sends both back.  Members whose masks are disjoint poll whatever the rest of the job
does; otherwise a group polls if the job's ranks on its host do not outnumber ``cpus``.
A mask that lists no CPU below 1024 (a host with more CPUs) makes the combination fall
back to each rank's own count.

    member  affinity   quota            combined
    0       {0..15}    none
    1       {0..15}    none        ->   cpus 16, disjoint False   (ranks share 16 CPUs)
    0       {0}        none
    1       {1}        none        ->   cpus 2, disjoint True     (a CPU each: poll)
    0       {0, 1}     none
    1       {0, 1}     1.5 CPUs    ->   cpus 1, disjoint False
"""

from __future__ import annotations

import os
import struct

MAX_CPU = 1024
MASK_BYTES = MAX_CPU // 8
_QUOTA = struct.Struct("<Q")
#: One member's message: its affinity mask, then its quota in whole CPUs (0: none).
INFO_BYTES = MASK_BYTES + _QUOTA.size


def affinity() -> set[int]:
    """The CPUs this thread may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def quota() -> int | None:
    """The cgroup v2 CPU quota in whole CPUs (at least 1), or None when there is none."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            limit, period = f.read().split()
        if limit != "max":
            return max(1, int(limit) // int(period))
    except (OSError, ValueError):
        pass
    return None


def usable() -> int:
    """CPUs this process may use on its own: its affinity, at most its quota."""
    q = quota()
    n = len(affinity())
    return n if q is None else min(n, q)


def info() -> bytes:
    """This rank's message for ``combine``."""
    mask = sum(1 << c for c in affinity() if c < MAX_CPU)
    return mask.to_bytes(MASK_BYTES, "little") + _QUOTA.pack(quota() or 0)


def combine(infos: list[bytes]) -> tuple[int, bool] | None:
    """``(cpus, disjoint)`` over every member's ``info()`` (see the module docstring), or
    None when some member's mask lists no CPU (it runs on CPUs from ``MAX_CPU`` on)."""
    union, total, quotas = 0, 0, []
    for blob in infos:
        mask = int.from_bytes(blob[:MASK_BYTES], "little")
        if mask == 0:
            return None
        union |= mask
        total += mask.bit_count()
        (q,) = _QUOTA.unpack_from(blob, MASK_BYTES)
        if q:
            quotas.append(q)
    cpus = union.bit_count()
    return (min([cpus, *quotas]), total == cpus)
