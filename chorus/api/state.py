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
    store: Any = None
    transport: Any = None
    groups: dict[int, ProcessGroup] = field(default_factory=dict)
    group_count: int = 0  # new_group calls so far (every rank calls it in the same order)
    rank: int = -1
    world_size: int = -1
    local_rank: int = 0
    local_world_size: int = 1


_process_world = World()
_thread_world: contextvars.ContextVar[World | None] = contextvars.ContextVar("chorus_world", default=None)


#: The World set for this thread (``use_world``), or None: the process's (``process_world``).
#: ``current()`` in one C call, for the latency paths (chorus.api.collectives).
thread_world = _thread_world.get
process_world = _process_world


def current() -> World:
    """The World of this rank (thread-local when ranks are threads)."""
    w = _thread_world.get()
    return w if w is not None else _process_world


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
