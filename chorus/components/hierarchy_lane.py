"""The latency lane of a group that spans hosts: a synchronous all_reduce of a small numpy
array (or torch CPU tensor, through a numpy view) runs its two phases
(chorus.components.hierarchy.all_reduce: in each host, then in each column) through the
sub-groups' own lanes, without a Call for the group or for either phase.

The phases are the general path's: the same sub-group ops (name, dtype, count, op: the
same fingerprints and sequence numbers), so a rank on this lane and a rank on the general
path work together, and so do a phase's lane and its general path (a phase whose lane
steps aside runs as a Call on its sub-group, as the general path runs it).  The group's
own op takes the group's next sequence number (``ProcessGroup.lane_op``) and tells the
transport when it finished.  A phase's error becomes the group's as on the general path
(``Hierarchy.failed``: a mismatch names the group's calls once every member's is known,
a lost peer names the op).

It steps aside where the general path is needed (besides ReduceLane's reasons): AVG and
PREMUL_SUM (their scaling hooks run around the phases), more than COLUMN_BYTES (or than
``CHORUS_HIER_RING_BYTES``: the ring's), hosts of different sizes (no columns), bfloat16
or an array numpy must copy, a group whose all_reduce was forced to a flat algorithm.
"""

from __future__ import annotations

import numpy as np

from chorus.call import make
from chorus.components.base import settled
from chorus.components.hierarchy import COLUMN_BYTES, Hierarchy
from chorus.components.lane import ReduceLane
from chorus.debug import flight
from chorus.errors import (
    CollectiveMismatchError,
    PeerLostError,
)
from chorus.reductions import combiner
from chorus.wire.fingerprint import fingerprint


class Plan:
    """One all_reduce of one (dtype, shape, op) on the group: the op (``op``, with
    ``combine`` for a phase run as a Call), the dtype name, the group op's fingerprint."""

    __slots__ = ("op", "combine", "dtype", "fingerprint")
    component = "hierarchical"
    algorithm = "columns"
    average = False  # AVG takes the general path

    def __init__(self, op, combine, dtype: str, fp: int):
        self.op, self.combine, self.dtype, self.fingerprint = op, combine, dtype, fp


class HierarchyLane(ReduceLane):
    """The latency lane of group ``pg`` whose collectives ``hierarchy`` runs (see the
    module docstring)."""

    def __init__(self, pg, hierarchy: Hierarchy):
        self.h = hierarchy
        self.flight = ring = flight.attach(pg)
        self._lane_init(pg, *(ring.lanes[0], ring.keys[0]) if ring is not None else (None, None))

    def all_to_all_now(self, out, inp) -> bool:
        """No all_to_all lane across hosts: the general path runs it."""
        return False

    def _lane_open(self) -> bool:
        return self.h.local.lane is not None

    def _reduce_plan(self, arr: np.ndarray, op):
        """The cached Plan for ``arr``'s dtype and shape and ``op``, or False."""
        buf, h = self._plan_start(arr, op), self.h
        if (buf is None or op.name in ("AVG", "PREMUL_SUM") or arr.nbytes > COLUMN_BYTES or h.column is None
                or "all_reduce" not in h.default or 0 < h.ring_from <= arr.nbytes or buf.copied
                or buf.dtype == "bfloat16"):
            return False
        plan = Plan(op, combiner(op, buf.dtype), buf.dtype, fingerprint("all_reduce", buf.dtype, buf.numel, -1, op.name))
        self.plans[(arr.dtype, arr.shape, op.name)] = plan
        return plan

    def _reduce_run(self, seq: int, plan: Plan, arr: np.ndarray) -> None:
        """Run ``plan`` as op ``seq`` of the group on ``arr``: each phase through its
        sub-group's lane, or as a Call on the sub-group where that lane steps aside."""
        pg, h = self.pg, self.h
        try:
            h.begin(seq, plan.fingerprint)
            for sub in (h.local, h.column):
                if not sub.lane.all_reduce_now(arr, plan.op):
                    self._phase_call(sub, plan, arr.reshape(-1))
        except (CollectiveMismatchError, PeerLostError) as exc:
            ctx = pg.context("all_reduce", seq, plan.fingerprint)
            raise settled(pg, h.failed(exc, ctx), ctx) from None
        pg.transport.finished(pg.id, seq, plan.fingerprint)

    @staticmethod
    def _phase_call(sub, plan: Plan, flat: np.ndarray) -> None:
        """The phase on ``sub`` as a Call, the way the general path runs it (its lane stepped aside)."""
        from chorus.components.select import start  # select imports the hierarchy

        start(make(sub, "all_reduce", dtype=plan.dtype, count=flat.size, buffers={"data": flat}, async_op=False,
                   algorithm=None, nbytes=flat.nbytes, args={"count": flat.size}, reduce_op=plan.op.name,
                   combine=plan.combine))
