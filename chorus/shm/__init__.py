"""Shared memory inside one host: a per-group window, written once and read many.

    segment.py     the /dev/shm file: create, attach, unlink, sweep(job_id)
    hostid.py      which ranks share a host (and a /dev/shm)
    handshake.py   creating a group's window; unlinking it once every member mapped it
    window.py      the window's layout and numpy views into it
    sync.py        generation counters, back-off, deadlines, failure checks
    collectives.py the algorithms (one-shot, reduce-scatter + all-gather, ...)
    group.py       ShmGroup: what chorus.api.launch.run hands a group's collectives to
    cma.py         Cross Memory Attach: reading and writing peers' buffers directly (single copy)
    ring.py        single-producer/single-consumer byte rings for point-to-point payloads
"""

from chorus.shm.segment import sweep

__all__ = ["sweep"]
