"""``Call``: one collective call, validated, as every component below the API sees it.

The API layer (chorus.api) checks a call's arguments and builds one ``Call``; from then on
nothing re-reads keyword arguments.  Selection (chorus.components.select) hands it to the
first component of the group that supports it, which runs it::

    dist.all_reduce(t, op=ReduceOp.SUM)                          (rank 1 of 4, 1 KiB float32)
      -> Call(name="all_reduce", group=WORLD, buffers={"data": t's array}, dtype="float32",
              count=256, nbytes=1024, reduce_op="SUM", root=-1, seq=17, fingerprint=...)
      -> hierarchical? no (one host)  -> shm? yes  -> ShmComponent.start(call, "window")

A Call is a named tuple: immutable, and cheap to build (one is built per op).

Fields:

``name``         the collective as the components know it: all_reduce, reduce, broadcast,
                 all_gather (all_gather_into_tensor too), gather, scatter, reduce_scatter
                 (reduce_scatter_tensor too), all_to_all (all_to_all_single too), barrier
``group``        the ProcessGroup
``buffers``      named flat arrays of one dtype (the regions schedules address):
                 ``data`` (in place), or ``input`` / ``output``; a rank that neither sends
                 nor receives a side (gather's non-roots) has no such entry
``dtype``        numpy dtype name of the elements
``count``        elements per rank (fingerprinted: every rank must agree)
``nbytes``       bytes per rank that the algorithm choice looks at
``args``         the algorithm's size arguments: ``count``, or ``counts`` (reduce_scatter),
                 or ``send_counts`` / ``recv_counts`` (all_to_all)
``reduce_op``    ReduceOp name, or "" for collectives that do not reduce
``root``         group rank of the root, or -1
``async_op``     whether the caller gets a Work back
``algorithm``    the algorithm the caller asked for (``algorithm=``), or None
``uniform``      whether every rank's block has one size (all_to_all, reduce_scatter)
``seq``          the group's sequence number of this op (taken in issue order)
``fingerprint``  hash of (name, dtype, count, root, reduce_op), compared across ranks
``combine``      ``combine(dst, src)``: dst <- dst op src, for reducing collectives
``before``       run just before the transfers (PREMUL_SUM's scaling), or None
``after``        run just after them (AVG's division, copies back to the caller's tensors)
``result``       what ``Work.result()`` returns
``device``       where the buffers live: ``"cpu"`` (numpy arrays) or ``"cuda"`` (flat torch
                 CUDA tensors, run by the CUDA component, chorus.cuda)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from chorus.errors import InvalidTensorError
from chorus.wire.fingerprint import fingerprint


class Call(NamedTuple):
    name: str
    group: Any  # chorus.process_group.ProcessGroup
    buffers: dict[str, np.ndarray]
    dtype: str
    count: int
    nbytes: int
    args: dict[str, Any]
    reduce_op: str
    root: int
    async_op: bool
    algorithm: str | None
    uniform: bool
    seq: int
    fingerprint: int
    combine: Callable[[np.ndarray, np.ndarray], None] | None
    before: Callable[[], None] | None
    after: Callable[[], None] | None
    result: list | None
    device: str = "cpu"

    def context(self):
        """The running op's context (chorus.engine.OpContext: identity, members, deadline
        counted from now)."""
        return self.group.context(self.name, self.seq, self.fingerprint)

    def on(self, group, name: str, buffers: dict[str, np.ndarray], args: dict[str, Any], *, root: int = -1,
           reduce: bool = False, count: int | None = None, uniform: bool = True) -> Call:
        """A synchronous call of collective ``name`` on ``group`` with this call's dtype (and
        reduction when ``reduce``): a phase of a composed op (chorus.components.hierarchy).
        It takes ``group``'s next sequence number; ``count`` defaults to ``args["count"]``."""
        count = args.get("count", 0) if count is None else count
        reduce_op = self.reduce_op if reduce else ""
        return Call(name, group, buffers, self.dtype, count, next(iter(buffers.values())).nbytes, args,
                    reduce_op, root, False, None, uniform, group.take_seq(),
                    fingerprint(name, self.dtype, count, root, reduce_op),
                    self.combine if reduce else None, None, None, None, self.device)


def make(group, name: str, *, dtype: str, count: int, buffers: dict[str, np.ndarray], async_op: bool,
         algorithm: str | None, nbytes: int, args: dict[str, Any] | None = None, root: int = -1, reduce_op: str = "",
         combine=None, before=None, after=None, result: list | None = None, uniform: bool = True) -> Call:
    """The Call of collective ``name`` issued now on ``group`` (it takes the group's next
    sequence number, so calls must be made in issue order).  Its device is its buffers'
    (InvalidTensorError when CPU and CUDA buffers are mixed)."""
    device = "cpu"
    for array in buffers.values():
        if type(array) is not np.ndarray:
            device = _device_of(buffers, name)
            break
    return Call(name, group, buffers, dtype, count, nbytes, args or {}, reduce_op, root, async_op, algorithm,
                uniform, group.take_seq(), fingerprint(name, dtype, count, root, reduce_op), combine,
                before, after, result, device)


def _device_of(buffers: dict[str, Any], name: str) -> str:
    kinds = {"cpu" if isinstance(a, np.ndarray) else a.device.type for a in buffers.values()}
    if len(kinds) > 1:
        raise InvalidTensorError(f"{name}: tensors on the CPU and on CUDA in one call; pass all on one device")
    return kinds.pop()
