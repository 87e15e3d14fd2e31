"""Which CPUs a group's ranks may run on, together: what decides whether a waiting rank
polls (chorus.shm.group.backoff_for).

Each rank knows only its own CPU affinity.  A rank pinned to one CPU (``taskset``,
``numactl``, a launcher that binds each rank to a core) sees one usable CPU, yet it has
that CPU to itself: judged alone it would count the host as oversubscribed and never
poll.  So at group creation every member sends its affinity, as a bit mask of CPUs
0..1023, and its cgroup CPU quota; group rank 0 combines them (``combine``): the members
are *apart* when no two masks share a CPU (each rank has CPUs of its own), and then
``cpus`` is the CPUs in their masks, at most the smallest quota.  Both go back to every
member (chorus.shm.handshake).

A group that holds every rank of the job and whose members are apart polls when its ranks
do not outnumber ``cpus``.  Any other group (a subgroup, whose non-members may be pinned
to the same CPUs; masks that overlap without being apart; a CPU from 1024 on) decides as
each rank sees it alone: the job's ranks against this process's usable CPUs.

    member  affinity   quota        combined
    0       {0..15}    none
    1       {0..15}    none    ->   not apart: each rank's own view (16 CPUs)
    0       {0}        none
    1       {1}        none    ->   apart, cpus 2: the job's 2 ranks poll
    0       {0}        none
    1       {0}        none
    2       {1, 2}     none    ->   not apart: each rank's own view (ranks 0 and 1 share CPU 0)
"""

from __future__ import annotations

import os
import struct

MAX_CPU = 1024
MASK_BYTES = MAX_CPU // 8
_TAIL = struct.Struct("<QB")  # quota in whole CPUs (0: none); 1 if this rank may run on CPUs from MAX_CPU on
#: One member's message: its affinity mask, then ``_TAIL``.
INFO_BYTES = MASK_BYTES + _TAIL.size


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
    cpus = affinity()
    mask = sum(1 << c for c in cpus if c < MAX_CPU)
    return mask.to_bytes(MASK_BYTES, "little") + _TAIL.pack(quota() or 0, any(c >= MAX_CPU for c in cpus))


def combine(infos: list[bytes]) -> int:
    """The CPUs of members that are apart (no two masks share a CPU), at most the smallest
    quota; 0 when they are not apart or some mask does not list every CPU of its rank."""
    union, quotas = 0, []
    for blob in infos:
        mask = int.from_bytes(blob[:MASK_BYTES], "little")
        q, beyond = _TAIL.unpack_from(blob, MASK_BYTES)
        if mask == 0 or beyond or union & mask:
            return 0
        union |= mask
        if q:
            quotas.append(q)
    return min([union.bit_count(), *quotas])
