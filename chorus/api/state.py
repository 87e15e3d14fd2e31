"""Where the current job's state lives: one :class:`World` per process — or per thread
when ranks run as threads (``chorus.testing``), selected through a context variable."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import Any

from chorus.errors import NotInitializedError
from chorus.process_group import ProcessGroup


@dataclass
class World:
    """Everything ``init_process_group`` creates; reset by ``destroy_process_group``."""

    default_group: ProcessGroup | None = None
    backend: str | None = None
    store: Any = None  # this init's view of the job's store (keys of one init apart from the next's)
    closes: Any = None  # the store destroy_process_group closes (the rendezvous's own)
    transport: Any = None
    channels: Any = None  # the job's extra TCP transports (chorus.components.channels), or None
    groups: dict[int, ProcessGroup] = field(default_factory=dict)
    group_count: int = 0  # new_group calls so far (every rank calls it in the same order)
    rank: int = -1
    world_size: int = -1
    local_rank: int = 0
    local_world_size: int = 1


_process_world = World()
_thread_world: contextvars.ContextVar[World] = contextvars.ContextVar("chorus_world", default=_process_world)

#: ``current()``: the World of this rank — the one ``use_world`` set for this thread (ranks
#: that are threads), else the process's.  The context variable's own ``get``: one C call,
#: as the latency paths (chorus.api.collectives, chorus.api.exchange) want.
current = _thread_world.get


def use_world(world: World) -> None:
    """Make ``world`` the current one for this thread (and what it spawns with a copied context)."""
    _thread_world.set(world)


def initialized_world(op: str) -> World:
    """The current World, or NotInitializedError naming ``op``."""
    w = current()
    if w.default_group is None:
        raise NotInitializedError(
            f"{op}: the default process group is not initialized; call "
            "chorus.init_process_group(...) first (or run under chorusrun / chorus.spawn)"
        )
    return w
