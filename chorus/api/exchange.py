"""Collectives where every rank sends a different block to every other:
``reduce_scatter``, ``reduce_scatter_tensor`` (``reduce_scatter_single``), ``all_to_all``,
``all_to_all_single`` (uneven splits)."""

from __future__ import annotations

import numpy as np

from chorus.api.calls import (
    collective,
    cuda_rows_now,
    lane,
    member_group,
    not_member,
    same_dtype,
    writable,
)
from chorus.buffers import as_buffer, clone, concat, empty
from chorus.errors import InvalidArgumentError
from chorus.reductions import ReduceOp, check_op, combiner, divide, scale
from chorus.work import Work


def _reduce_scatter(out, input_array, counts, in_dtype: str, op, pg, async_op, algorithm, name, result):
    check_op(op, out.dtype, name)
    if in_dtype != out.dtype:
        raise InvalidArgumentError(f"{name}: input is {in_dtype} but output is {out.dtype}")
    if out.numel != counts[pg.rank()]:
        raise InvalidArgumentError(
            f"{name}: output has {out.numel} elements but this rank's block of the input has {counts[pg.rank()]}")
    data = input_array
    before = None
    if op.name == "PREMUL_SUM":  # the input stays unchanged: scale a copy
        data = clone(input_array)

        def before() -> None:
            scale(data, out.dtype, op.factor)

    def after() -> None:
        if op.name == "AVG":
            divide(out.array, out.dtype, pg.size())
        out.finish()

    return collective(pg, "reduce_scatter", dtype=out.dtype, count=int(sum(counts)), async_op=async_op,
               buffers={"input": data, "output": out.array}, algorithm=algorithm,
               nbytes=out.nbytes, reduce_op=op.name, combine=combiner(op, out.dtype), before=before,
               after=after, result=result, uniform=len(set(counts)) <= 1, args={"counts": tuple(counts)})


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op: bool = False,
                   algorithm: str | None = None) -> Work | None:
    """Reduce ``input_list[i]`` over all ranks into rank i's ``output``.

    rank 0: [[1], [2]]  rank 1: [[3], [4]]  --reduce_scatter(SUM)-->  rank 0: [4]  rank 1: [6]
    """
    pg = member_group(group, "reduce_scatter")
    if pg is None:
        return not_member(async_op)
    out = writable(output, "reduce_scatter", "output")
    if not isinstance(input_list, (list, tuple)) or len(input_list) != pg.size():
        raise InvalidArgumentError(f"reduce_scatter: input_list must hold {pg.size()} tensors (one per rank)")
    ins = [as_buffer(t, op="reduce_scatter", what="input_list") for t in input_list]
    dtype = same_dtype(ins, "reduce_scatter", "input_list tensors")
    flat = concat([b.array for b in ins], out.array)
    return _reduce_scatter(out, flat, [b.numel for b in ins], dtype, op, pg, async_op, algorithm,
                           "reduce_scatter", [output])


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op: bool = False,
                          algorithm: str | None = None) -> Work | None:
    """Reduce-scatter one tensor: block i of ``input`` (world_size equal blocks) is reduced
    over all ranks into rank i's ``output``.

    rank 0: in=[1, 2]   rank 1: in=[3, 4]   --SUM-->   rank 0: out=[4]   rank 1: out=[6]
    """
    if algorithm is None:
        done = cuda_rows_now("reduce_scatter", output, input, op, group, async_op)
        if done is not None:
            return done if async_op else None
    pg = member_group(group, "reduce_scatter_tensor")
    if pg is None:
        return not_member(async_op)
    out = writable(output, "reduce_scatter_tensor", "output")
    src = as_buffer(input, op="reduce_scatter_tensor", what="input")
    if src.numel != pg.size() * out.numel:
        raise InvalidArgumentError(
            f"reduce_scatter_tensor: input has {src.numel} elements, needs world_size ({pg.size()}) x "
            f"{out.numel} = {pg.size() * out.numel}")
    return _reduce_scatter(out, src.array, [out.numel] * pg.size(), src.dtype, op, pg, async_op, algorithm,
                           "reduce_scatter_tensor", [output])


reduce_scatter_single = reduce_scatter_tensor
_reduce_scatter_base = reduce_scatter_tensor


def _all_to_all(pg, out_array, in_array, send_counts, recv_counts, dtype, async_op, algorithm, after, result):
    uniform = len(set(send_counts) | set(recv_counts)) <= 1
    return collective(pg, "all_to_all", dtype=dtype, count=0, async_op=async_op,
               buffers={"input": in_array, "output": out_array}, algorithm=algorithm,
               nbytes=int(max(send_counts, default=0)) * in_array.itemsize, after=after, result=result,
               uniform=uniform, args={"send_counts": tuple(send_counts), "recv_counts": tuple(recv_counts)})


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False,
               algorithm: str | None = None) -> Work | None:
    """Rank j's ``input_tensor_list[i]`` lands in rank i's ``output_tensor_list[j]``.

    rank 0: in=[[a0],[a1]]  rank 1: in=[[b0],[b1]]  -->  rank 0: out=[[a0],[b0]]  rank 1: out=[[a1],[b1]]
    Blocks may differ in size; each output must match the block it receives.
    """
    pg = member_group(group, "all_to_all")
    if pg is None:
        return not_member(async_op)
    w = pg.size()
    for name, lst in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
        if not isinstance(lst, (list, tuple)) or len(lst) != w:
            raise InvalidArgumentError(f"all_to_all: {name} must hold {w} tensors (one per rank)")
    ins = [as_buffer(t, op="all_to_all", what="input_tensor_list") for t in input_tensor_list]
    outs = [writable(t, "all_to_all", "output_tensor_list") for t in output_tensor_list]
    dtype = same_dtype(ins + outs, "all_to_all", "tensors")
    flat_in = concat([b.array for b in ins], outs[0].array)
    flat_out = empty(sum(b.numel for b in outs), flat_in)

    def after() -> None:
        offset = 0
        for b in outs:
            b.array[...] = flat_out[offset: offset + b.numel]
            b.finish()
            offset += b.numel

    return _all_to_all(pg, flat_out, flat_in, [b.numel for b in ins], [b.numel for b in outs], dtype,
                       async_op, algorithm, after, list(output_tensor_list))


def _split_counts(splits, tensor_buf, tensor, world: int, what: str) -> list[int]:
    rows = tensor.shape[0] if len(tensor.shape) else 1
    per_row = tensor_buf.numel // rows if rows else 0
    if splits is None:
        if rows % world:
            raise InvalidArgumentError(
                f"all_to_all_single: {what} has {rows} rows, not divisible by world_size {world}; "
                f"pass {what}_split_sizes")
        return [rows // world * per_row] * world
    splits = [int(s) for s in splits]
    if len(splits) != world or sum(splits) != rows or min(splits, default=0) < 0:
        raise InvalidArgumentError(
            f"all_to_all_single: {what}_split_sizes {splits} must have {world} non-negative entries "
            f"summing to the {rows} rows of the {what}")
    return [s * per_row for s in splits]


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                      async_op: bool = False, algorithm: str | None = None) -> Work | None:
    """All-to-all over the first dimension: rank j's rows for rank i land in rank i's
    ``output`` at block j.  ``*_split_sizes`` give uneven row counts per rank.

    rank 0: in=[a0, a1]   rank 1: in=[b0, b1]   -->   rank 0: out=[a0, b0]   rank 1: out=[a1, b1]
    """
    if (type(output) is np.ndarray and type(input) is np.ndarray and output_split_sizes is None
            and input_split_sizes is None and not async_op and algorithm is None):
        window = lane(group)
        if window is not None and window.all_to_all_now(output, input):
            return None
    pg = member_group(group, "all_to_all_single")
    if pg is None:
        return not_member(async_op)
    out = writable(output, "all_to_all_single", "output")
    src = as_buffer(input, op="all_to_all_single", what="input")
    dtype = same_dtype([src, out], "all_to_all_single", "tensors")
    send = _split_counts(input_split_sizes, src, input, pg.size(), "input")
    recv = _split_counts(output_split_sizes, out, output, pg.size(), "output")
    return _all_to_all(pg, out.array, src.array, send, recv, dtype, async_op, algorithm, out.finish, [output])
