"""The small helpers of a training script's ``distributed.py`` (see the seeds' note on
communication primitives), ready to import::

    from chorus.utils import reduce_tensor, gather_tensor, broadcast_tensor, barrier, is_main_process

    loss = reduce_tensor(loss, op="mean")      # every rank: the mean over ranks
    preds = gather_tensor(preds, dst=0)        # rank 0: [rank 0's, rank 1's, ...]; others: None
    seed = broadcast_tensor(seed, src=0)       # every rank: rank 0's seed (in place)
    if is_main_process():
        print("logged once")

Every helper also works when the job is not distributed (``init_process_group`` was not
called): the process is rank 0 of a world of 1 and the operations return their input
(``gather_tensor`` returns ``[tensor]``), so one script runs both on a laptop and under
``chorusrun``.  Tensors are numpy arrays or torch CPU tensors.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from chorus.api.collectives import all_reduce, broadcast
from chorus.api.collectives import barrier as _barrier
from chorus.api.gathering import all_gather_into_tensor, gather
from chorus.api.init import get_rank as _get_rank
from chorus.api.init import get_world_size as _get_world_size
from chorus.api.init import is_initialized
from chorus.buffers import as_buffer, is_torch_tensor
from chorus.errors import InvalidArgumentError

__all__ = ["all_gather_tensor", "barrier", "broadcast_tensor", "gather_tensor", "get_device", "get_rank",
           "get_world_size", "is_distributed", "is_main_process", "reduce_tensor"]


def is_distributed() -> bool:
    """True once ``init_process_group`` was called (and until ``destroy_process_group``)."""
    return is_initialized()


def get_rank() -> int:
    """This process's rank; 0 when not distributed."""
    return _get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """The number of ranks; 1 when not distributed."""
    return _get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """True on rank 0 (and when not distributed): the process that logs and saves."""
    return get_rank() == 0


def get_device() -> str:
    """The device to put tensors on for communication: ``"cpu"`` (chorus moves CPU memory)."""
    return "cpu"


def barrier() -> None:
    """Wait until every rank got here; returns at once when not distributed."""
    if is_distributed():
        _barrier()


def _copy(tensor: Any) -> Any:
    """A fresh copy of a numpy array or torch tensor (numbers become 0-d arrays)."""
    if is_torch_tensor(tensor):
        return tensor.detach().clone()
    return np.array(tensor, copy=True)


def _new(like: Any, shape: tuple[int, ...]) -> Any:
    """A zeroed array/tensor of ``like``'s kind and dtype with ``shape``."""
    if is_torch_tensor(like):
        return like.new_zeros(shape)
    return np.zeros(shape, like.dtype)


def reduce_tensor(tensor: Any, op: str = "mean") -> Any:
    """Sum (``op="sum"``) or average (``op="mean"``) ``tensor`` over all ranks; every rank
    gets the result as a new tensor, the input is left unchanged.

    rank 0: loss=0.5  rank 1: 0.3  rank 2: 0.7  rank 3: 0.4  ->  sum: 1.9 on all;  mean: 0.475 on all

    The mean of an integer tensor is a float tensor (sum / world size).  Not
    distributed: returns ``tensor`` itself.
    """
    if op not in ("sum", "mean"):
        raise InvalidArgumentError(f'reduce_tensor: op must be "sum" or "mean", got {op!r}')
    if not is_distributed():
        return tensor
    result = _copy(tensor)
    all_reduce(result)  # SUM
    if op == "mean":
        result = result / get_world_size()
        if not is_torch_tensor(result):
            result = np.asarray(result)  # numpy turns a 0-d quotient into a scalar
    return result


def gather_tensor(tensor: Any, dst: int = 0) -> list | None:
    """Rank ``dst`` gets a list of every rank's ``tensor`` (index = rank); others get None.

    rank 0: [0.8, 0.2]  rank 1: [0.1, 0.7]  --dst=0-->  rank 0: [[0.8, 0.2], [0.1, 0.7]]  rank 1: None

    Every rank's tensor must have the same shape and dtype.  Not distributed: ``[tensor]``.
    """
    if not is_distributed():
        return [tensor]
    as_buffer(tensor, op="gather_tensor")  # a clear error for anything but a tensor
    if get_rank() != dst:
        gather(tensor, None, dst=dst)
        return None
    out = [_new(tensor, tuple(tensor.shape)) for _ in range(get_world_size())]
    gather(tensor, out, dst=dst)
    return out


def broadcast_tensor(tensor: Any, src: int = 0) -> Any:
    """Copy rank ``src``'s ``tensor`` into ``tensor`` on every rank (in place) and return it.

    rank 0: [1., 2., 3.]  rank 1: [0., 0., 0.]  --src=0-->  both: [1., 2., 3.]

    Not distributed: returns ``tensor`` unchanged.
    """
    if is_distributed():
        broadcast(tensor, src=src)
    return tensor


def _fingerprint(text: str) -> int:
    return zlib.crc32(text.encode())


def all_gather_tensor(tensor: Any) -> Any:
    """Every rank gets all ranks' tensors concatenated along the first dimension, in rank
    order; the first dimensions may differ between ranks.

    rank 0: [[1, 2]]   rank 1: [[3, 4], [5, 6]]   ->   both: [[1, 2], [3, 4], [5, 6]]

    The other dimensions and the dtype must agree on every rank (a 0-d tensor counts as
    one row).  How: all-gather the row counts, pad to the longest, all-gather, drop the
    padding.  Not distributed: returns ``tensor`` unchanged.
    """
    if not is_distributed():
        return tensor
    as_buffer(tensor, op="all_gather_tensor")  # a clear error for anything but a tensor
    rows = tensor.reshape(1, *tensor.shape) if tensor.ndim == 0 else tensor
    tail = tuple(rows.shape[1:])
    world = get_world_size()
    header = np.array([len(rows), rows.ndim, _fingerprint(repr(tail)), _fingerprint(str(rows.dtype))], np.int64)
    headers = np.zeros((world, len(header)), np.int64)
    all_gather_into_tensor(headers, header)
    _check_headers(headers, tail, str(rows.dtype))
    counts = headers[:, 0]
    longest = int(counts.max())
    padded = _new(rows, (longest, *tail))
    padded[:len(rows)] = rows
    everything = _new(rows, (world * longest, *tail))
    if longest:
        all_gather_into_tensor(everything, padded)
    result = _new(rows, (int(counts.sum()), *tail))
    start = 0
    for rank, count in enumerate(counts.tolist()):
        result[start:start + count] = everything[rank * longest:rank * longest + count]
        start += count
    return result


def _check_headers(headers: np.ndarray, tail: tuple[int, ...], dtype: str) -> None:
    """Every rank sees all headers, so every rank raises the same error."""
    for column, what in ((1, "number of dimensions"), (2, "shape after the first dimension"), (3, "dtype")):
        differ = np.flatnonzero(headers[:, column] != headers[0, column]).tolist()
        if differ:
            raise InvalidArgumentError(
                f"all_gather_tensor: ranks {differ} pass a tensor whose {what} differs from rank 0's "
                f"(this rank: shape {_shape(tail)}, dtype {dtype}); only the first "
                "dimension may differ between ranks")


def _shape(tail: tuple[int, ...]) -> str:
    """``(n, 3, 4)`` for a tail of (3, 4): n is the first dimension, free to differ."""
    return "(" + ", ".join(["n", *map(str, tail)]) + ("," if not tail else "") + ")"
