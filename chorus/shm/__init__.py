"""Shared memory inside one host: a per-group window, written once and read many.

    segment.py      the /dev/shm file: create, attach, unlink, sweep(job_id)
    handshake.py    the members' census: who shares a host, and whether to share memory
    window.py       a group's window: its layout, creation and numpy views into it
    placement.py    where work runs: CPUs, how waits back off, threads per rank
    sync.py         waiting: generation counters, back-off, wake-ups, deadlines, failure checks
    phases.py       how an op divides its work: phases, parities, chunks, parts (and the crew)
    collectives.py  the algorithms over the window (one-shot, reduce-scatter + all-gather, ...)
    cma.py          copies between buffers: Cross Memory Attach, and copies at slow offsets
    direct.py       single copy: the collectives that read peers' buffers directly
    registered.py   buffers in shared files (chorus.empty_shared, torch storages moved there)
    mapped.py       the peers' registered buffers, mapped here, and the collectives on them
    group.py        ShmGroup: what chorus.api.launch.run hands a group's collectives to
    ring.py         single-producer/single-consumer byte rings for point-to-point payloads
"""

from chorus.host.segment import sweep

__all__ = ["sweep"]
