"""A group's CUDA workspace at its first CUDA op (chorus.cuda.component.attach): its size
from CHORUS_CUDA_WORKSPACE_BYTES, made, mapped by every member and checked
(chorus.cuda.workspace), or the reason it could not be (the component then stages
through host memory, or, across hosts, runs rails: chorus.cuda.rails)."""

from __future__ import annotations

import logging
import time

from chorus import config

log = logging.getLogger("chorus")

DEFAULT_WORKSPACE_BYTES = 64 << 20


def setting(name: str, default: int) -> int:
    """A CHORUS_CUDA_* setting (declared in chorus.config)."""
    value = config.get(name)
    if value in (None, ""):
        return default
    return int(value)


def phase_note(phases: dict[str, float]) -> str:
    """The set-up's steps and their seconds, for a log line.

    >>> phase_note({"allocate": 0.0123, "exchange": 0.2})
    'allocate 0.012 s, exchange 0.200 s'
    """
    return ", ".join(f"{name} {s:.3f} s" for name, s in phases.items())


def workspace(pg):
    """(workspace, "") for group ``pg``, or (None, why not); collective: every member
    calls it at the same op."""
    from chorus.api.state import current
    from chorus.cuda.workspace import Unusable, Workspace

    store = current().store
    total = setting("CHORUS_CUDA_WORKSPACE_BYTES", DEFAULT_WORKSPACE_BYTES)
    generation = (store.add(f"cuda/{pg.id}/attaches", 1) - 1) // pg.size()
    prefix = f"cuda/{pg.id}/{generation}"
    if setting("CHORUS_CUDA_STAGING", 0):
        return None, "CHORUS_CUDA_STAGING=1"
    started = time.perf_counter()
    try:
        ws = Workspace.create(pg, store, prefix, total)
    except (Unusable, ImportError) as exc:
        return None, str(exc)
    ws.setup_s = time.perf_counter() - started
    lay = ws.layout
    log.info("chorus rank %d: group %s's CUDA workspace: %.1f MiB on this GPU (slots 2 x %.1f MiB, graph "
             "slots 2 x %.1f MiB, channels 2 x %d x %.1f MiB), allocated, mapped by %d ranks and checked "
             "in %.3f s (%s)", pg.members[pg.rank()], pg.name, lay.total / 2**20, lay.slot / 2**20,
             lay.graph / 2**20, pg.size(), lay.channel / 2**20, pg.size(), ws.setup_s, phase_note(ws.phases))
    return ws, ""
