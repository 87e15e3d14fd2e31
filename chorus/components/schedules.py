"""Schedules over the group's transport: every algorithm of chorus.schedules, run by
chorus.engine over TCP (or the loopback transport of ranks that are threads).

It supports every call: it is the last component of every group, the one that runs what
no other takes.  The algorithm is, in order: ``algorithm=`` of the call, the group's
``CHORUS_ALGO_<COLLECTIVE>`` (read when the group was made), the size rules of
chorus.selection.
"""

from __future__ import annotations

from collections.abc import Callable

from chorus import config
from chorus.call import Call
from chorus.components.base import Component, run_in_order
from chorus.components.channels import GroupChannels
from chorus.engine import run_schedule
from chorus.schedules.registry import schedule as build_schedule
from chorus.selection import COLLECTIVES, choose, without_hierarchy
from chorus.wire.dtypes import DTYPE_CODES
from chorus.work import Work

#: from this many ranks a ring all_reduce sends each chunk as one message, unless
#: CHORUS_SEGMENT_BYTES is set (on every rank: the ranks' schedules must agree).  Measured
#: where every CPU was busy, which pieces cannot use (the reading and the reducing thread
#: need a CPU each to overlap); not measured across real hosts.  W = 16 over TCP on the
#: 16-vCPU host, 64 MiB, gloo's time over chorus's in each round: 1 MiB pieces 0.86, 1.03,
#: 1.05, 0.92; whole 4 MiB chunks 1.09, 1.09, 1.02, 1.13; 256 KiB pieces 0.63-0.83
#: (docs/results/16-vcpu-h200-host/ring-segment-330cf78/); whole chunks by default in the
#: next call: 1.14, 1.04, 1.02, 1.10, 0.97 (whole-chunks-5490c1d/)
WHOLE_CHUNKS_FROM = 16


def forced_algorithms() -> dict[str, str]:
    """``CHORUS_ALGO_<COLLECTIVE>`` for every collective where it is set: {name: algorithm}."""
    forced = {}
    for name in COLLECTIVES:
        value = config.get(f"CHORUS_ALGO_{name.upper()}")
        if value:
            forced[name] = value
    return forced


class ScheduleComponent(Component):
    """Runs calls as schedules over ``transport``-level messages (see the module docstring).

    ``announce(ctx)``: called as each op starts, when the group also has a shared-memory
    window that this op bypasses (so that the window's waiters can name a rank that went
    another way)."""

    name = "tcp"

    def __init__(self, announce: Callable[[object], None] | None = None, channels: GroupChannels | None = None):
        self.forced = forced_algorithms()
        self.announce = announce
        self.segment = config.get("CHORUS_SEGMENT_BYTES")
        self.segment_set = config.is_set("CHORUS_SEGMENT_BYTES")
        self.channels = channels  # a large all_reduce's parts on the job's channels (chorus.components.channels)

    def supports(self, call: Call) -> str:
        requested = call.algorithm
        if requested is not None:
            requested = without_hierarchy(call.name, requested)
        return choose(call.name, call.group.size(), call.nbytes, requested, call.uniform,
                      self.forced.get(call.name))

    def default(self, name: str, world: int, nbytes: int) -> str:
        """The algorithm a call of ``name`` moving ``nbytes`` per rank, with no
        ``algorithm=``, runs with here (what ``supports`` answers for it)."""
        return choose(name, world, nbytes, None, True, self.forced.get(name))

    def schedule(self, pg, name: str, algorithm: str, args: dict, root: int, itemsize: int):
        """This rank's schedule of ``name`` run with ``algorithm`` on ``pg`` (``args``: the
        call's size arguments; ``itemsize``: bytes per element): the one ``start`` runs."""
        args = dict(args)
        if root >= 0:
            args["root"] = root
        if algorithm in ("ring", "chain") and name in ("all_reduce", "broadcast"):
            args["segment"] = max(1, self.segment // max(1, itemsize))  # the pipelining unit
            if name == "all_reduce" and pg.size() >= WHOLE_CHUNKS_FROM and not self.segment_set:
                args["segment"] = 0  # one message per chunk (see WHOLE_CHUNKS_FROM)
        return build_schedule(name, algorithm, pg.rank(), pg.size(), **args)

    def start(self, call: Call, algorithm: str) -> Work | None:
        pg = call.group
        itemsize = next(iter(call.buffers.values())).itemsize if call.buffers else 1
        code = DTYPE_CODES[call.dtype]
        announce = self.announce
        channels = self.channels if call.name == "all_reduce" else None
        if channels is not None:
            parts = channels.parts(call.nbytes)
            if parts > 1:
                return run_in_order(call, self.name, algorithm,
                                    lambda ctx: self.in_parts(call, algorithm, ctx, parts, itemsize, code),
                                    channels=parts)
        sched = self.schedule(pg, call.name, algorithm, call.args, call.root, itemsize)

        def transfers(ctx) -> None:
            if announce is not None:
                announce(ctx)
            pg.run_schedule(sched, call.buffers, ctx, code, call.combine, algorithm)

        return run_in_order(call, self.name, algorithm, transfers)

    def in_parts(self, call: Call, algorithm: str, ctx, parts: int, itemsize: int, code: int) -> None:
        """``call`` (an all_reduce) as ``parts`` all_reduces of contiguous parts of its data,
        part k on channel k (chorus.components.channels), each with the op's context."""
        pg = call.group
        data = call.buffers["data"]

        def run_part(k: int, offset: int, size: int, transport, workspace) -> None:
            sched = self.schedule(pg, "all_reduce", algorithm, {"count": size}, -1, itemsize)
            part = {"data": data[offset:offset + size]}
            if transport is None:
                pg.run_schedule(sched, part, ctx, code, call.combine, algorithm, channel=0)
            else:
                run_schedule(sched, part, transport, ctx, code, call.combine, workspace, algorithm, channel=k)

        self.channels.run(ctx, parts, data.size, run_part)

    def close(self) -> None:
        if self.channels is not None:
            self.channels.close()
