"""Where a rank's work runs: the CPUs it may use, how it waits, how many threads it uses.

Decided once per group, when its window is created (chorus.shm.handshake):

* ``backoff``: whether a waiting rank polls (chorus.shm.sync.Backoff).  Polling pays only
  where every rank of the host has a core of its own; elsewhere a poller takes the CPU
  from the rank it waits for.
* ``threads``: how many threads a rank splits its large copies among (the crew,
  chorus.shm.phases.Crew): the CPUs shared among the host's ranks.

Each rank knows only its own CPU affinity.  A rank pinned to one CPU (``taskset``,
``numactl``, a launcher that binds each rank to a core) sees one usable CPU, yet it has
that CPU to itself: judged alone it would count the host as oversubscribed and never
poll.  So at group creation every member sends its affinity (``info``), as a bit mask of
CPUs 0..1023, and its cgroup CPU quota; group rank 0 combines them (``combine``): the
members are *apart* when no two masks share a CPU (each rank has CPUs of its own), and
then ``cpus`` is the CPUs in their masks, at most the smallest quota.  Both go back to
every member.

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

Settings (chorus.config, read when the group is created): ``CHORUS_SHM_SPIN_US`` (spin
this long before yielding, wherever the ranks run), ``CHORUS_SHM_YIELD_US`` (yield this
long before napping), ``CHORUS_SHM_POLLS`` (counter reads before a sync starts waiting),
``CHORUS_SHM_THREADS`` (threads per rank).
"""

from __future__ import annotations

import dataclasses
import logging
import struct

from chorus import config
from chorus.host.cpus import affinity, quota, ranks_here, usable
from chorus.shm.sync import Backoff

log = logging.getLogger("chorus")

MAX_CPU = 1024
MASK_BYTES = MAX_CPU // 8
_TAIL = struct.Struct("<QB")  # quota in whole CPUs (0: none); 1 if this rank may run on CPUs from MAX_CPU on
#: One member's message: its affinity mask, then ``_TAIL``.
INFO_BYTES = MASK_BYTES + _TAIL.size
#: Threads per rank at most, by default.
MAX_THREADS = 4


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


def backoff(transport, world: int, apart: int) -> Backoff:
    """How a member of a group of ``world`` ranks over ``transport`` waits: the job's ranks
    against this process's usable CPUs, or, when the group holds every rank of the job
    and no two members' affinities overlap, against the ``apart`` CPUs they have."""
    threads = transport.name == "loopback"  # ranks are threads of this process
    job = transport.world_size
    if apart and world >= job:
        return backoff_for(world, threads, apart)
    return backoff_for(max(world, job), threads)


def backoff_for(ranks_here: int, threads: bool, cpus_here: int | None = None) -> Backoff:
    """Poll (``CHORUS_SHM_POLLS`` reads of a missing rank's counter, a few us, before a
    sync starts waiting) only when every rank on the host has a core of its own:
    ``ranks_here`` ranks on ``cpus_here`` CPUs (default: this process's, ``usable``).
    Ranks that are threads of one process share the GIL: they never poll.
    ``CHORUS_SHM_SPIN_US`` spins (and polls) wherever they run; ``CHORUS_SHM_YIELD_US``
    sets how long a waiter yields before it naps (default 5 ms, 1 ms with more ranks than
    CPUs)."""
    spin, yield_us, polls = (config.get(name) for name in
                             ("CHORUS_SHM_SPIN_US", "CHORUS_SHM_YIELD_US", "CHORUS_SHM_POLLS"))
    if spin is not None:
        chosen = Backoff(spin_s=spin * 1e-6, polls=polls)
    elif threads or ranks_here > (usable() if cpus_here is None else cpus_here):
        chosen = Backoff(spin_s=0.0, yield_s=1e-3)
    else:
        chosen = Backoff(polls=polls)
    return dataclasses.replace(chosen, yield_s=yield_us * 1e-6) if yield_us else chosen


def threads(transport, world: int) -> int:
    """Threads per rank for large copies: the CPUs shared among this host's ranks, counted
    by the launcher's LOCAL_WORLD_SIZE (a hint only: it decides no correctness, just how
    many helpers), else by the whole job."""
    return threads_for(max(world, ranks_here(transport.world_size)), usable(), transport.name == "loopback")


def threads_for(ranks_here: int, cpus: int, thread_ranks: bool) -> int:
    """Threads per rank (``CHORUS_SHM_THREADS``, else ``cpus // ranks_here``, 1 to
    MAX_THREADS; ranks that are threads of one process share the GIL: 1).

    A malformed ``CHORUS_SHM_THREADS`` is reported and ignored rather than raised: it is
    read while the group's window is being set up, where one rank failing alone would
    leave the others waiting for it."""
    try:
        value = config.get("CHORUS_SHM_THREADS")
    except config.ConfigError as exc:
        log.warning("chorus: %s; using the default", exc)
        value = None
    if value is not None:
        return value
    if thread_ranks:
        return 1
    return max(1, min(MAX_THREADS, cpus // max(1, ranks_here)))
