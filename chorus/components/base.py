"""The interface every collective component implements, and the op runner they share.

A component is one way of running collectives on one group: schedules over the group's
transport (chorus.components.schedules), the group's shared-memory window
(chorus.components.shm), the composition of sub-groups across hosts
(chorus.components.hierarchy), later CUDA.  Each group holds an ordered tuple of them,
made when the group is created (chorus.components.select.attach); per call, selection
asks each in turn::

    algorithm = component.supports(call)     # a name, or None: "not this call"
    work = component.start(call, algorithm)  # None for a synchronous call

``supports`` must give the same answer on every rank (it may read only the Call's
fields, which every rank shares, and facts agreed when the group was made).  ``start``
runs the call in issue order (``run_in_order``): inline when the call is synchronous and
the group idle, else on the group's worker; it reports the op to the recorder.
"""

from __future__ import annotations

from collections.abc import Callable

from chorus import recorder
from chorus.call import Call
from chorus.debug import flight
from chorus.errors import CollectiveMismatchError
from chorus.work import QueuedWork, Work


class Component:
    """Base class.  ``name`` shows in recorder events and errors."""

    name = "component"

    def supports(self, call: Call) -> str | None:
        """The algorithm this component would run ``call`` with, or None."""
        raise NotImplementedError

    def start(self, call: Call, algorithm: str) -> Work | None:
        """Run ``call`` (see the module docstring)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the component holds (the group is being destroyed)."""


def run_in_order(call: Call, component: str, algorithm: str, transfers: Callable[[object], None],
                 **detail) -> Work | None:
    """Run ``transfers(ctx)`` (the op's data movement) for ``call`` in issue order, between
    the call's ``before``/``after`` hooks, with recorder ``begin``/``end`` events around it;
    ``ctx`` is the op's context, its deadline counted from when the op starts.  The group's
    flight recorder (chorus.debug.flight) notes the op queued, started, done or failed."""

    pg = call.group
    try:
        ring = pg.flight
    except AttributeError:
        ring = flight.attach(pg)
    entry = None
    if ring is not None:  # the flight recorder: the op, queued (chorus.debug.flight)
        entry = [call, component, algorithm, flight.QUEUED, flight.clock(), 0.0, 0.0, None, call.seq]
        log = ring.log
        log.append(entry)
        if len(log) > ring.trim_at:
            flight.trim(ring)

    def body() -> list | None:
        if entry is not None:
            entry[flight.STATE] = flight.STARTED
            entry[flight.STARTED_AT] = flight.clock()
        ctx = None
        try:
            if call.before is not None:
                call.before()
            ctx = call.context()
            if recorder.current is None:
                transfers(ctx)
            else:
                recorder.op("begin", ctx, component, algorithm, **detail)
                try:
                    transfers(ctx)
                except BaseException as exc:
                    recorder.op("end", ctx, component, algorithm, error=f"{type(exc).__name__}: {exc}")
                    raise
                recorder.op("end", ctx, component, algorithm)
            if call.after is not None:
                call.after()
        except BaseException as exc:
            error = settled(pg, exc, ctx)
            if entry is not None:
                flight.failed(entry, pg.members[ring.group_rank], error)
            if error is exc:
                raise
            raise error from None
        if entry is not None:
            entry[flight.CALL] = flight.summary(call)  # (not the Call: its buffers would stay alive)
            entry[flight.STATE] = flight.DONE
            entry[flight.ENDED_AT] = flight.clock()
        return call.result

    out = call.group.submit(body, call.async_op)
    return QueuedWork(out, call.result) if call.async_op else None


def settled(pg, error: BaseException, ctx) -> BaseException:
    """``error`` as op ``ctx`` of ``pg`` raises it: a CollectiveMismatchError first waits,
    briefly and once per group, for every member's call (Transport.settled), to name them;
    not in a group whose ops are phases of another's (``pg.phase_of``): that group's op
    raises its own mismatch, settled there, and a wait here would only delay it."""
    if not isinstance(error, CollectiveMismatchError) or pg.phase_of is not None:
        return error
    return pg.transport.settled(error, pg.members, None if ctx is None else ctx.deadline)
