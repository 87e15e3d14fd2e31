"""The recorder: one stream of events that every collective component reports into.

A listener attached here (``attach(fn)``) is called with an :class:`Event` for

* ``begin`` / ``end`` of every op: the call's identity (group, sequence number,
  collective, fingerprint), the component that ran it and the algorithm it chose;
  ``end`` carries the error, if the op failed;
* every transfer or phase inside an op: ``send`` and ``recv`` (TCP schedules, with the
  peer's global rank), ``sync`` (a shared-memory window sync), ``copy`` (into or out of
  a window, or a single copy from a peer's memory), ``reduce`` (a local reduction) and
  ``phase`` (a sub-group's op inside a hierarchical one), with bytes and times.

With no listener attached the cost is one module-attribute test per op (``current is
None``); the latency paths of the shared-memory component step aside to the general
path while a listener is attached, so every op is seen.

Times are ``time.perf_counter()`` seconds of this process.  The flight recorder, traces
and ``chorus explain --trace`` are listeners.

Example::

    events = []
    chorus.recorder.attach(events.append)
    dist.all_reduce(t)
    chorus.recorder.detach()
    [(e.what, e.op, e.component) for e in events]
    # [('begin', 'all_reduce', 'shm'), ('copy', 'all_reduce', 'shm'), ('sync', ...), ...]
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Event", "attach", "detach", "current", "op", "transfer"]


class Event:
    """One thing that happened on this rank.

    ``what``: begin, end, send, recv, sync, copy, reduce or phase.  ``group``, ``seq``,
    ``op`` (collective name), ``fingerprint``: the call.  ``component`` and ``algorithm``:
    who ran it and how.  ``peer``: a global rank, or -1.  ``nbytes``: bytes moved or
    reduced.  ``start`` / ``end``: perf_counter seconds (equal for instants).  ``detail``:
    anything else (``error`` on a failed ``end``, a sub-group's name on ``phase``).
    """

    __slots__ = ("what", "group", "seq", "op", "fingerprint", "component", "algorithm", "peer",
                 "nbytes", "start", "end", "detail")

    def __init__(self, what: str, group: int, seq: int, op: str, fingerprint: int, component: str,
                 algorithm: str, peer: int, nbytes: int, start: float, end: float, detail: dict):
        self.what = what
        self.group = group
        self.seq = seq
        self.op = op
        self.fingerprint = fingerprint
        self.component = component
        self.algorithm = algorithm
        self.peer = peer
        self.nbytes = nbytes
        self.start = start
        self.end = end
        self.detail = detail

    def __repr__(self) -> str:
        where = f" peer={self.peer}" if self.peer >= 0 else ""
        return (f"Event({self.what} {self.op}#{self.seq} g{self.group} {self.component}/{self.algorithm}"
                f"{where} {self.nbytes}B {1e6 * (self.end - self.start):.1f}us)")


#: The attached listener, or None.  Components test ``recorder.current is not None``
#: before building an event.
current: Callable[[Event], None] | None = None


def attach(listener: Callable[[Event], None]) -> None:
    """Send every event of this process to ``listener`` (replacing any other)."""
    global current
    current = listener


def detach() -> None:
    """Stop recording."""
    global current
    current = None


def op(what: str, ctx, component: str, algorithm: str = "", **detail) -> None:
    """Report ``begin`` or ``end`` of op ``ctx`` (anything with ``name``, ``group``,
    ``seq`` and ``fingerprint``: a Call or an OpContext)."""
    listener = current
    if listener is not None:
        now = time.perf_counter()
        listener(Event(what, ctx.group, ctx.seq, ctx.name, ctx.fingerprint, component, algorithm, -1, 0,
                       now, now, detail))


def transfer(what: str, ctx, component: str, start: float, nbytes: int = 0, peer: int = -1,
             algorithm: str = "", **detail) -> None:
    """Report a transfer or phase of op ``ctx`` that began at ``start`` and ends now."""
    listener = current
    if listener is not None:
        listener(Event(what, ctx.group, ctx.seq, ctx.name, ctx.fingerprint, component, algorithm, peer,
                       nbytes, start, time.perf_counter(), detail))
