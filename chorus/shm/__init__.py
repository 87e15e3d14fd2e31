"""Shared memory inside one host: a per-group window, written once and read many.

    segment.py     the /dev/shm file: create, attach, unlink, sweep(job_id)
    hostid.py      which ranks share a host (and a /dev/shm)
    handshake.py   creating a group's window; unlinking it once every member mapped it
    window.py      the window's layout and numpy views into it
    sync.py        generation counters, back-off, deadlines, failure checks
    phases.py      how an op divides its work: phases, parities, chunks, parts
    collectives.py the algorithms (one-shot, reduce-scatter + all-gather, ...)
    crew.py        helper threads that split a rank's large copies
    settings.py    CHORUS_SHM_* numbers from the environment
    group.py       ShmGroup: what chorus.api.launch.run hands a group's collectives to
    cma.py         Cross Memory Attach: reading and writing peers' buffers directly (single copy)
    direct.py      the single-copy collectives
    registered.py  buffers in shared files (chorus.empty_shared, torch storages moved there)
    peer_maps.py   the peers' registered buffers, mapped here
    mapped.py      collectives on registered buffers: plain loads and stores, no copy through the window
    ring.py        single-producer/single-consumer byte rings for point-to-point payloads
"""

from chorus.shm.segment import sweep

__all__ = ["sweep"]
