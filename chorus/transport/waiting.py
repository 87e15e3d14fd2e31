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
import threading
import time

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
