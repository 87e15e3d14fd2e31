"""Which component runs a call, and the component stack each group gets when it is made.

Every group holds its components in the order they are asked (``pg.components``)::

    members on one host          (ShmComponent, ScheduleComponent)
    members on several hosts,    (Hierarchy, ScheduleComponent)
      several on some host
    anything else                (ScheduleComponent,)

and ``pg.lane``, the component whose latency lanes the API tries first for a small
synchronous call: the shared-memory component on one host, the TCP lane
(chorus.components.tcp_lane) where the schedules component runs everything, none for a
hierarchy (its phases run on sub-groups).

and, from its first call on a device, that device's component (``pg.device_components``).

``start(call)`` hands the call to the first component whose ``supports(call)`` names an
algorithm.  The schedules component supports every call, so a call always finds one; a
call it cannot run (an unknown ``algorithm=``) raises InvalidArgumentError there, before
anything is sent.  Every input of the choice is the same on every rank (the Call's
fields, and facts the members agreed on when the group was made), so every rank picks the
same component and algorithm.
"""

from __future__ import annotations

import importlib

from chorus.call import Call
from chorus.components.channels import GroupChannels
from chorus.components.schedules import ScheduleComponent, forced_algorithms
from chorus.components.shm import ShmComponent
from chorus.components.tcp_lane import TcpLane
from chorus.errors import InvalidTensorError
from chorus.work import Work


def start(call: Call) -> Work | None:
    """Run ``call`` on the first component of its group that supports it (a call on a
    device other than the CPU: on the group's component for that device)."""
    if call.device != "cpu":
        component = device_component(call.group, call.device)
        return component.start(call, component.supports(call))
    for component in call.group.components:
        algorithm = component.supports(call)
        if algorithm is not None:
            return component.start(call, algorithm)
    raise AssertionError(f"no component of group {call.group.name} runs {call.name}")  # schedules run all


def device_component(pg, device: str):
    """``pg``'s component for ``device`` (``"cuda"``), made at its first use: the package
    ``chorus.<device>`` is loaded by name (it imports torch; the core never does), and its
    ``component.attach(pg)`` runs on every member of the group that uses the device."""
    component = pg.device_components.get(device)
    if component is None:
        try:
            module = importlib.import_module(f"chorus.{device}.component")
        except ImportError as exc:
            raise InvalidTensorError(
                f"chorus cannot move {device} tensors here: {exc}. Install chorus[{device}] "
                "(torch with CUDA, triton, cuda-bindings)") from None
        component = pg.device_components[device] = module.attach(pg)
    return component


def attach(pg, *, settings: bool = True) -> None:
    """Give ``pg`` its components (every member calls this when the group is made; the
    shared-memory handshake inside is collective).  ``settings=False``: the group ignores
    ``CHORUS_ALGO_*`` (a hierarchy's host-local sub-group: the setting chose the parent's
    path already)."""
    if not pg.is_member():
        return
    from chorus.shm.handshake import create  # imported here so that `import chorus` stays fast

    pg.shm, hosts = create(pg.transport, pg.id, pg.members, pg.rank(), pg.timeout)
    if pg.shm is not None:
        forced = frozenset(name for name, algo in forced_algorithms().items() if algo != "hierarchical")
        window = ShmComponent(pg, pg.shm, forced if settings else frozenset())
        pg.components = (window, ScheduleComponent(announce=pg.shm.announce_tcp))
        pg.lane = window
        return
    from chorus.components.hierarchy import build  # it makes sub-groups, attached here

    pg.hierarchy = build(pg, hosts, attach)
    if pg.hierarchy is None:
        split = GroupChannels(pg, pg.channels) if pg.channels is not None else None
        schedules = ScheduleComponent(channels=split)
        pg.components = (schedules,)
        pg.lane = TcpLane(pg, schedules)
    else:
        from chorus.components.hierarchy_lane import HierarchyLane

        pg.components = (pg.hierarchy, pg.hierarchy.schedules)
        pg.lane = HierarchyLane(pg, pg.hierarchy) if pg.hierarchy.column is not None else None


def detach(pg) -> None:
    """Release ``pg``'s components (the group is being destroyed)."""
    pg.lane = None
    for component in (*pg.components, *pg.device_components.values()):
        component.close()
    pg.device_components.clear()
