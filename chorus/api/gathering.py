"""Collectives that assemble or distribute blocks: ``all_gather``,
``all_gather_into_tensor`` (``all_gather_single``), ``gather``, ``scatter``."""

from __future__ import annotations

import numpy as np

from chorus.api.calls import (
    collective,
    cuda_rows_now,
    member_group,
    not_member,
    root_rank,
    same_dtype,
    writable,
)
from chorus.buffers import Buffer, as_buffer, concat, empty
from chorus.errors import InvalidArgumentError
from chorus.work import Work


def _blocks(tensors, op: str, what: str, world: int, like: Buffer, write: bool) -> list[Buffer]:
    """Validate a list of ``world`` tensors shaped like ``like``; return their buffers."""
    if not isinstance(tensors, (list, tuple)) or len(tensors) != world:
        got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise InvalidArgumentError(f"{op}: {what} must be a list of {world} tensors (one per rank), got {got}")
    bufs = [writable(t, op, what) if write else as_buffer(t, op=op, what=what) for t in tensors]
    same_dtype([like, *bufs], op, f"{what} and the tensor")
    bad = [i for i, b in enumerate(bufs) if b.numel != like.numel]
    if bad:
        raise InvalidArgumentError(
            f"{op}: {what}[{bad[0]}] has {bufs[bad[0]].numel} elements, the tensor has {like.numel}; "
            "all must have the same number of elements")
    return bufs


def _scatter_into(bufs: list[Buffer], flat: np.ndarray, count: int) -> None:
    for i, b in enumerate(bufs):
        b.array[...] = flat[i * count: (i + 1) * count]
        b.finish()


def all_gather(tensor_list, tensor, group=None, async_op: bool = False,
               algorithm: str | None = None) -> Work | None:
    """Every rank gets every rank's ``tensor``: ``tensor_list[i]`` = rank i's tensor.

    rank 0: t=[1]  rank 1: t=[2]   --all_gather-->   both: tensor_list = [[1], [2]]
    """
    pg = member_group(group, "all_gather")
    if pg is None:
        return not_member(async_op)
    src = as_buffer(tensor, op="all_gather")
    outs = _blocks(tensor_list, "all_gather", "tensor_list", pg.size(), src, write=True)
    flat = empty(pg.size() * src.numel, src.array)
    return collective(pg, "all_gather", dtype=src.dtype, count=src.numel, async_op=async_op,
               buffers={"input": src.array, "output": flat}, algorithm=algorithm, nbytes=src.nbytes,
               after=lambda: _scatter_into(outs, flat, src.numel), result=list(tensor_list),
               args={"count": src.numel})


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op: bool = False,
                           algorithm: str | None = None) -> Work | None:
    """All-gather into one tensor: rank i's input lands at block i of ``output_tensor``
    (``output_tensor`` has world_size times as many elements, concatenated or stacked).

    rank 0: in=[1, 2]   rank 1: in=[3, 4]   -->   both: out=[1, 2, 3, 4] (or [[1, 2], [3, 4]])
    """
    if algorithm is None:
        done = cuda_rows_now("all_gather", output_tensor, input_tensor, None, group, async_op)
        if done is not None:
            return done if async_op else None
    pg = member_group(group, "all_gather_into_tensor")
    if pg is None:
        return not_member(async_op)
    src = as_buffer(input_tensor, op="all_gather_into_tensor", what="input_tensor")
    out = writable(output_tensor, "all_gather_into_tensor", "output_tensor")
    same_dtype([src, out], "all_gather_into_tensor", "tensors")
    if out.numel != pg.size() * src.numel:
        raise InvalidArgumentError(
            f"all_gather_into_tensor: output_tensor has {out.numel} elements, needs world_size "
            f"({pg.size()}) x {src.numel} = {pg.size() * src.numel}")
    return collective(pg, "all_gather", dtype=src.dtype, count=src.numel, async_op=async_op,
               buffers={"input": src.array, "output": out.array}, algorithm=algorithm, nbytes=src.nbytes,
               after=out.finish, result=[output_tensor], args={"count": src.numel})


all_gather_single = all_gather_into_tensor
_all_gather_base = all_gather_into_tensor


def gather(tensor, gather_list=None, dst: int | None = None, group=None, async_op: bool = False,
           group_dst: int | None = None, algorithm: str | None = None) -> Work | None:
    """Rank ``dst`` gets every rank's ``tensor`` in ``gather_list`` (other ranks pass none).

    rank 0: t=[1]  rank 1: t=[2]   --gather(dst=0)-->   rank 0: gather_list = [[1], [2]]
    """
    pg = member_group(group, "gather")
    if pg is None:
        return not_member(async_op)
    root = root_rank(pg, dst, group_dst, "gather", "dst")
    src = as_buffer(tensor, op="gather")
    buffers = {"input": src.array}
    after = None
    if pg.rank() == root:
        outs = _blocks(gather_list, "gather", "gather_list", pg.size(), src, write=True)
        flat = empty(pg.size() * src.numel, src.array)
        buffers["output"] = flat

        def after() -> None:
            _scatter_into(outs, flat, src.numel)
    elif gather_list:
        raise InvalidArgumentError("gather: gather_list must be empty or None on ranks other than dst")
    return collective(pg, "gather", dtype=src.dtype, count=src.numel, async_op=async_op, buffers=buffers,
               algorithm=algorithm, nbytes=src.nbytes, root=root, after=after,
               result=list(gather_list or []), args={"count": src.numel})


def scatter(tensor, scatter_list=None, src: int | None = None, group=None, async_op: bool = False,
            group_src: int | None = None, algorithm: str | None = None) -> Work | None:
    """Rank ``src`` sends ``scatter_list[i]`` to rank i, which receives it in ``tensor``.

    rank 0: scatter_list = [[1], [2]]   --scatter(src=0)-->   rank 0: t=[1]   rank 1: t=[2]
    """
    pg = member_group(group, "scatter")
    if pg is None:
        return not_member(async_op)
    root = root_rank(pg, src, group_src, "scatter", "src")
    out = writable(tensor, "scatter")
    buffers = {"output": out.array}
    if pg.rank() == root:
        ins = _blocks(scatter_list, "scatter", "scatter_list", pg.size(), out, write=False)
        buffers["input"] = concat([b.array for b in ins], out.array)
    elif scatter_list:
        raise InvalidArgumentError("scatter: scatter_list must be empty or None on ranks other than src")
    return collective(pg, "scatter", dtype=out.dtype, count=out.numel, async_op=async_op, buffers=buffers,
               algorithm=algorithm, nbytes=out.nbytes, root=root, after=out.finish, result=[tensor],
               args={"count": out.numel})
