"""What every collective function of the API shares: resolve the group, check tensors,
and turn the validated arguments into one Call (chorus.call) that the group's components
run (chorus.components)."""

from __future__ import annotations

from typing import Any

from chorus.api.groups import resolve, warn_not_in_group
from chorus.api.state import current
from chorus.buffers import Buffer, as_buffer, is_torch_tensor
from chorus.call import make
from chorus.components.select import start
from chorus.errors import InvalidArgumentError
from chorus.process_group import ProcessGroup
from chorus.work import CompletedWork, Work


def member_group(group: Any, op: str) -> ProcessGroup | None:
    """The group to run on, or None (after a warning) when this rank is not a member."""
    pg = resolve(group, op)
    if pg is None:
        warn_not_in_group(op)
    return pg


def not_member(async_op: bool) -> Work | None:
    return CompletedWork() if async_op else None


def writable(tensor: Any, op: str, what: str = "tensor") -> Buffer:
    buf = as_buffer(tensor, op=op, what=what)
    if not buf.writable:
        raise InvalidArgumentError(f"{op}: {what} is read-only; pass a writable array")
    return buf


def same_dtype(bufs: list[Buffer], op: str, what: str) -> str:
    dtypes = {b.dtype for b in bufs}
    if len(dtypes) > 1:
        raise InvalidArgumentError(f"{op}: all {what} must have one dtype, got {sorted(dtypes)}")
    return bufs[0].dtype


def root_rank(pg: ProcessGroup, root: int | None, group_root: int | None, op: str, name: str) -> int:
    """Validate ``src``/``dst`` (global) or ``group_src``/``group_dst``; return the group rank."""
    if root is not None and group_root is not None:
        raise InvalidArgumentError(f"{op}: pass either {name}= or group_{name}=, not both")
    if group_root is not None:
        pg.global_rank(group_root, op=op, what=f"group_{name}")
        return group_root
    return pg.group_rank(0 if root is None else root, op=op, what=name)


def collective(pg: ProcessGroup, name: str, **fields: Any) -> Work | None:
    """Issue collective ``name`` on ``pg`` now: build its Call (chorus.call.make: the fields
    are the Call's, the sequence number is taken here, in issue order) and hand it to the
    group's components (chorus.components.select).  One thread at a time per group
    (ProcessGroup.enter)."""
    took = pg.enter(name)
    try:
        return start(make(pg, name, **fields))
    finally:
        if took:
            pg.leave()


def lane(group: Any):
    """The shared-memory component of ``group`` (None: the default group) whose latency
    lanes a synchronous call may try first, or None (not initialized, not a member, no
    window, not a ProcessGroup: the general path decides)."""
    world = current()
    if world.default_group is None:
        return None
    pg = world.default_group if group is None else group if type(group) is ProcessGroup else None
    return None if pg is None else pg.lane


def device_lane(group: Any, device: str):
    """The component of ``group`` (None: the default group) for ``device`` when it exists
    already (a synchronous call may try its latency lane first), else None."""
    world = current()
    if world.default_group is None:
        return None
    pg = world.default_group if group is None else group if type(group) is ProcessGroup else None
    return None if pg is None else pg.device_components.get(device)


def cuda_rows_now(name: str, output: Any, input: Any, op: Any, group: Any, async_op: bool):
    """all_gather_into_tensor / reduce_scatter_tensor (``name`` "all_gather" /
    "reduce_scatter") of CUDA tensors through the group's CUDA lane where it takes them
    (chorus.cuda.component.rows_now): True or its Work, else None (the general path)."""
    if not (is_torch_tensor(input) and input.is_cuda and is_torch_tensor(output)):
        return None
    gpu = device_lane(group, "cuda")
    done = False if gpu is None else gpu.rows_now(name, output, input, op, async_op)
    return None if done is False else done
