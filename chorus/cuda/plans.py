"""The plans of a CUDA group's latency lane (``CudaComponent.all_reduce_now``,
``rows_now``): what a repeated all_reduce of one (dtype, shape, op), or all_gather_into_tensor
/ reduce_scatter_tensor of one (dtype, shapes, op), needs, worked out once; and
``LaneLog``, what the flight recorder keeps of the ops that ran them.

A plan says which dtype name and fingerprint the call carries (as the API would name
them: every rank's fingerprints must agree whichever path it took), how many elements
of what size, and who runs it: chorus's kernels (by algorithm) or, from the group's
hand-off size, NCCL (``algorithm == "nccl"``).  AVG runs as SUM and the lane divides
after, as the general path does.
"""

from __future__ import annotations

from typing import NamedTuple

from chorus.buffers import dtype_name_of
from chorus.cuda import algorithms as A
from chorus.cuda import staging
from chorus.cuda.layout import GRAIN
from chorus.cuda.nccl import nccl_reduces
from chorus.debug import flight
from chorus.wire.fingerprint import fingerprint

#: plans cached per group (dtype, shape, op) before the cache starts over
PLANS = 256
#: the reductions the lane takes (PREMUL_SUM scales first: the general path's)
LANE_OPS = frozenset({"SUM", "PRODUCT", "MIN", "MAX", "AVG", "BAND", "BOR", "BXOR"})


class Plan(NamedTuple):
    dtype: str  # chorus's dtype name
    fingerprint: int
    reduce_op: str
    count: int
    item: int  # bytes per element
    algorithm: str  # chorus.cuda.algorithms' choice, or "nccl"
    average: bool  # AVG: divide by the group's size after the sum


def all_reduce_plan(tensor, op, reducible: frozenset, nccl_from: int, world: int) -> Plan | None:
    """The plan of all_reduce(``tensor``, ``op``) on a group of ``world`` ranks whose
    kernels reduce the dtypes ``reducible`` and which hands all_reduces of ``nccl_from``
    bytes and more to NCCL (0: never); None where the general path must decide (it
    raises the errors, scales PREMUL_SUM, takes empty tensors)."""
    name = staging.torch_dtype_name(tensor)
    kind = lane_reduction(op, name, tensor, reducible)
    if kind is None or tensor.numel() == 0:
        return None
    count, item = tensor.numel(), tensor.element_size()
    try:
        fp = fingerprint("all_reduce", name, count, -1, kind)
    except (KeyError, ValueError):
        return None
    if nccl_from and count * item >= nccl_from and nccl_reduces(name, kind):
        algorithm = "nccl"  # (as CudaComponent's general path chooses: dtypes NCCL does not reduce stay)
    else:
        algorithm = A.all_reduce_algorithm(count * item, world)
    return Plan(name, fp, kind, count, item, algorithm, kind == "AVG")


def lane_reduction(op, name: str, tensor, reducible: frozenset) -> str | None:
    """The name of reduce op ``op`` where a lane takes it on ``tensor`` (dtype ``name``),
    else None: PREMUL_SUM (scaled first), a dtype the kernels do not reduce, AVG of
    integers and bitwise ops of floats or bools (the API's errors) are the general path's."""
    import torch

    kind = getattr(op, "name", None)
    if kind not in LANE_OPS or name not in reducible or (kind == "AVG" and not tensor.is_floating_point()):
        return None
    if kind in ("BAND", "BOR", "BXOR") and (tensor.is_floating_point() or tensor.dtype == torch.bool):
        return None
    return kind


def cached_plan(plans: dict, tensor, op, reducible: frozenset, nccl_from: int, world: int) -> Plan | bool:
    """all_reduce_plan(...), or False, kept in ``plans`` under (dtype, shape, op)."""
    if len(plans) >= PLANS:
        plans.clear()
    plan = plans[(tensor.dtype, tensor.shape, op)] = all_reduce_plan(tensor, op, reducible, nccl_from, world) or False
    return plan


class RowsPlan(NamedTuple):
    """A repeated all_gather_into_tensor or reduce_scatter_tensor (``name``: the Call's,
    "all_gather" or "reduce_scatter") as one round of its fused kernel
    (chorus.cuda.gather): ``m`` elements of each rank's block, rows ``stride`` apart."""

    name: str
    dtype: str
    fingerprint: int
    reduce_op: str
    m: int
    stride: int
    item: int
    average: bool
    algorithm: str = "fused"


def rows_plan(name: str, output, input, op, world: int, reducible: frozenset, nccl_from: int,
              slot_bytes: int) -> RowsPlan | None:
    """The plan of ``name`` ("all_gather" or "reduce_scatter") from ``input`` into
    ``output`` on a group of ``world`` ranks whose kernels reduce ``reducible``, whose
    all_gather / reduce_scatter go to NCCL from ``nccl_from`` bytes of the whole buffer
    (0: never), through slots of ``slot_bytes``; None where the general path must decide
    (it raises the errors, hands off to NCCL, takes several rounds, scales PREMUL_SUM)."""
    gather = name == "all_gather"
    m = input.numel() if gather else output.numel()
    if input.dtype != output.dtype or m == 0 or (output if gather else input).numel() != world * m:
        return None
    dtype, item = dtype_name_of(input), input.element_size()
    kind = "" if gather else lane_reduction(op, dtype, input, reducible)
    if (gather and item not in A.GATHER_ITEMS) or kind is None:
        return None
    if (nccl_from and world * m * item >= nccl_from) or m > A.rows_chunk(slot_bytes, item, world):
        return None
    try:
        fp = fingerprint(name, dtype, m if gather else world * m, -1, kind)  # (as the API's Call)
    except (KeyError, ValueError):
        return None
    return RowsPlan(name, dtype, fp, kind, m, -(-m // GRAIN) * GRAIN, item, kind == "AVG")


class Dtype(NamedTuple):
    """A lane op's dtype as the flight recorder's dump reads it (numpy's dtype has no
    bfloat16)."""

    name: str
    itemsize: int


class Noted(NamedTuple):
    """A lane plan as the flight recorder notes it, per (plan, async_op)."""

    fingerprint: int
    algorithm: str
    async_op: bool
    component = "cuda"  # (the dump's component column)


class LaneLog:
    """The flight recorder's list of a CUDA group's lane ops (``ring.lanes[2]``, its plan
    keys in ``ring.keys[2]``: chorus.debug.flight), kept as the CPU lanes keep theirs."""

    def __init__(self, ring: flight.Ring):
        self.ring = ring
        self.seqs, self.keys = ring.lanes[2], ring.keys[2]
        self.last: tuple | None = None  # (plan, async_op) of the last key noted

    def began(self, seq: int, plan: Plan, op, shape, async_op: bool) -> None:
        """Lane op ``seq`` runs ``plan`` (a plan key noted where it changed: a plan object
        is made for one (dtype, shape, op) alone, so the same plan means the same three)."""
        last = self.last
        if last is None or last[0] is not plan or last[1] != async_op:
            self.last = (plan, async_op)
            self.keys.append((len(self.seqs), (Dtype(plan.dtype, plan.item), op, tuple(shape),
                                               Noted(plan.fingerprint, plan.algorithm, async_op))))
        self.seqs.append(seq)
        ring = self.ring
        if seq >= ring.clock_at:
            flight.tick(ring, seq)

    def failed(self, seq: int, exc: BaseException) -> None:
        ring = self.ring
        flight.failed_lane(ring, seq, ring.members[ring.group_rank], exc)
