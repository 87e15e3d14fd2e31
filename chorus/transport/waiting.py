"""Waiting reports: an op that waits long for other ranks says so, now and then::

    chorus rank 0: still waiting for rank(s) [1] in all_reduce #6 on group WORLD (30 s)

Each group has one :class:`WaitReport` (made with the group, from CHORUS_WAIT_REPORT_S).
The waits call :meth:`WaitReport.line` once per interval while they last: a transport's
wait on its handles (``Transport.wait_all``: the peers whose data has not arrived, or
whose receive has not taken a rendezvous send) and a shared-memory sync (chorus.shm.sync:
the ranks that have not reached it).  A wait that ends within the interval pays nothing
for this, and one that finds its transfers done pays nothing at all: the report is
looked up only once a wait has to block.  Lines are WARNING records of the "chorus"
logger.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from chorus.transport.rendezvous_sends import PROBE_AFTER_S, PROBE_EVERY_S, RendezvousSends

log = logging.getLogger("chorus")


class WaitReport:
    """The waiting reports of one group: rank ``rank`` (global), group name ``group``,
    ``interval`` seconds between lines (0: none)."""

    __slots__ = ("rank", "group", "interval", "_last", "_lock")

    def __init__(self, rank: int, group: str, interval: float):
        self.rank = rank
        self.group = group
        self.interval = interval
        self._last = -float("inf")  # time.monotonic() of the group's last line
        self._lock = threading.Lock()

    def line(self, missing: list[int], op: str, waited: float, any_source: bool = False) -> bool:
        """Log that op ``op`` ("all_reduce #6") has waited ``waited`` seconds for the global
        ranks ``missing`` (and, ``any_source``, for a message from any rank) — unless a line
        of this group went out less than an interval ago, as when two threads wait in the
        same group.  True if the line went out."""
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval:
                return False
            self._last = now
        who = f"rank(s) {missing}" if missing else ""
        if any_source:
            who += " or any rank" if who else "any rank"
        shown = f"{waited:.1f}" if waited < 10 else f"{waited:.0f}"
        log.warning("chorus rank %d: still waiting for %s in %s on group %s (%s s)",
                    self.rank, who, op, self.group, shown)
        return True


def wait_long(handle, handles: list, deadline: float | None, label: Callable[[], str],
              report: WaitReport | None, sends: RendezvousSends) -> None:
    """Wait for ``handle`` (one of ``handles``, not done) in slices: every interval of the
    group's ``report``, log the ranks ``handles`` still wait for; while a rendezvous send
    among them waits for its receive, search for a deadlock now and then (``sends``).
    Returns once ``handle`` is done or at ``deadline``; the caller's own wait then ends at
    once."""
    interval = report.interval if report is not None else 0.0
    waiting = sends.waiting_in(handles) if sends.pending else None
    if not interval and not waiting:
        return
    start = time.monotonic()
    next_line = start + interval if interval else math.inf
    next_search = start + PROBE_AFTER_S if waiting else math.inf
    end = math.inf if deadline is None else deadline
    if waiting:
        sends.block(waiting, 1)
    try:
        while True:
            until = min(next_line, next_search, end)
            if handle.wait(None if until == math.inf else until):
                return
            now = time.monotonic()
            if now >= end:
                return
            if now >= next_search:
                sends.search(waiting)
                next_search = now + PROBE_EVERY_S
            if now >= next_line:
                missing = sorted({h.peer for h in handles if not h.done() and h.peer is not None})
                any_source = any(h.peer is None and not h.done() for h in handles)
                if missing or any_source:
                    report.line(missing, label(), now - start, any_source)
                next_line = now + interval
    finally:
        if waiting:
            sends.block(waiting, -1)
