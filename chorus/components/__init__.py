"""Collective components: the ways a group can run a collective, behind one interface
(chorus.components.base.Component: ``supports(call)``, ``start(call, algorithm)``).

    schedules.py   ScheduleComponent: chorus.schedules over the transport (TCP, loopback)
    shm.py         ShmComponent: the group's shared-memory window, and its latency lanes
    hierarchy.py   Hierarchy: shared memory inside each host, TCP between hosts
    select.py      which component runs a call; the stack each group gets when made
"""
