"""One benchmark case per collective, defined once for every library.

The buffers, their contents and the expected results (:func:`pattern`, :func:`counts`,
:func:`expected`, :class:`Buffers`) are shared by all libraries; only the step differs.
chorus and torch gloo run the same torch.distributed calls (:func:`make_case`, ``api`` =
chorus or torch.distributed); MPI runs mpi4py's buffer calls on the same numpy arrays
(``chorus.bench.mpi_worker``).  :func:`time_case` times a case the same way everywhere.

Every rank's input is ``pattern(rank, n)[i] = rank + 1 + i % 7``, so a misplaced block
or a missing contribution shows.  ``size`` is nccl-tests' size: the bytes of the larger
of the two buffers (the full output of all_gather, the full input of reduce_scatter).
A case is ``(reset, step, check)``: ``reset`` restores the inputs (untimed), ``step`` runs
one collective (timed), ``check`` counts wrong elements (untimed).

Timing (:func:`time_case`): the ops of one size run back to back in batches, as OSU and
nccl-tests time them, yet every op is still checked: each op of a batch has buffers of
its own, reset before the batch and checked after it, and every batch starts from a
barrier (as OSU's benchmarks time each iteration), so that an op's time never includes
another rank's untimed reset and check: without it, a 256 MiB op on rank 0 was charged
with the slowest rank's check of the op before, and the same case varied up to 4x from
run to run.  A batch's buffers stay within
``BATCH_BYTES`` (about an L2 cache: sizes that fit a cache stay cached, as with one reused
buffer), so sizes from 512 KiB get batches of one op (timed alone, reset and checked
between ops).  Back to back matters for small messages: timing ops one at a time would
charge each op with the other ranks' late arrival from their untimed reset and check.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
               "sendrecv", "barrier")
#: Collectives that take a reduction (``--op``).
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
#: ``--op`` names -> torch.distributed / chorus ReduceOp member names.
OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG",
       "band": "BAND", "bor": "BOR", "bxor": "BXOR"}
FLOAT_OPS = ("sum", "prod", "min", "max", "avg")
INT_OPS = ("sum", "prod", "min", "max", "band", "bor", "bxor")
DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64")
#: Untimed ops per library (256 elements) before the first timed size.
WARMUP_OPS = 50
#: A batch of back-to-back ops keeps its buffers within this many bytes per rank: about
#: what L2 holds, so that sizes that fit a cache stay cached as with one reused buffer.
BATCH_BYTES = 1 << 20
#: Results are checked this many elements at a time.
_CHECK_ELEMS = 1 << 18
#: Each collective divides its buffer into this many blocks (count rounded down to a multiple).
_BLOCKED = ("all_gather", "reduce_scatter", "all_to_all")


def check_op(collective: str, op: str, dtype: str) -> str | None:
    """Why ``op`` cannot be benchmarked with ``dtype`` (None: it can)."""
    if dtype not in DTYPES:
        return f"dtype {dtype!r} is not benchmarked; use one of {', '.join(DTYPES)}"
    if op not in OPS:
        return f"op {op!r} is unknown; use one of {', '.join(OPS)}"
    if collective not in REDUCING:
        return None
    allowed = FLOAT_OPS if np.dtype(dtype).kind == "f" else INT_OPS
    if op not in allowed:
        return f"op {op} is not defined for {dtype}; use one of {', '.join(allowed)}"
    return None


def op_label(collective: str, op: str) -> str:
    """The table's op column: the reduction for reducing collectives, else 'none'."""
    return op if collective in REDUCING else "none"


def pattern(rank: int, n: int, dtype: str) -> np.ndarray:
    return (rank + 1 + np.arange(n) % 7).astype(dtype)


def counts(collective: str, size_elems: int, world: int) -> tuple[int, int]:
    """(input elements, output elements) per rank; 0 output = in place."""
    block = size_elems // world
    return {
        "all_reduce": (size_elems, 0), "broadcast": (size_elems, 0), "reduce": (size_elems, 0),
        "all_gather": (block, block * world), "reduce_scatter": (block * world, block),
        "all_to_all": (block * world, block * world), "sendrecv": (size_elems, size_elems),
        "barrier": (0, 0),
    }[collective]


def sweep_counts(sizes: list[int], collective: str, world: int, itemsize: int) -> list[int]:
    """Element counts for a sweep of byte sizes: whole elements (a multiple of ``world``
    for the blocked collectives, as nccl-tests does), no empty or repeated size; barrier
    has one size, 0."""
    if collective == "barrier":
        return [0]
    unit = world if collective in _BLOCKED else 1
    out: list[int] = []
    for nbytes in sizes:
        count = nbytes // itemsize // unit * unit
        if count > 0 and count not in out:
            out.append(count)
    return out


def _reduce_all(op: str, world: int, n: int, dtype: str) -> np.ndarray:
    """Every rank's pattern reduced element-wise with ``op`` (floats in float64; integers
    in their own dtype, whose wrap-around is the same in any order)."""
    work = np.dtype(dtype) if np.dtype(dtype).kind in "iu" else np.dtype(np.float64)
    fn = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
          "max": np.maximum, "band": np.bitwise_and, "bor": np.bitwise_or,
          "bxor": np.bitwise_xor}[op]
    acc = pattern(0, n, dtype).astype(work)
    with np.errstate(over="ignore"):
        for r in range(1, world):
            acc = fn(acc, pattern(r, n, dtype).astype(work))
        if op == "avg":
            acc = acc / world
    return acc


def expected(collective: str, rank: int, world: int, n_in: int, n_out: int, dtype: str,
             op: str = "sum") -> np.ndarray | None:
    """What the checked buffer must hold after one step (None: nothing to check)."""
    if collective == "all_reduce" or (collective == "reduce" and rank == 0):
        return _reduce_all(op, world, n_in, dtype)
    if collective == "broadcast":
        return pattern(0, n_in, dtype)
    if collective == "reduce":  # torch.distributed leaves the other ranks' tensors unspecified
        return None
    block = n_out // world if collective != "reduce_scatter" else n_out
    if collective == "all_gather":
        return np.concatenate([pattern(r, block, dtype) for r in range(world)])
    if collective == "reduce_scatter":
        return _reduce_all(op, world, n_in, dtype)[rank * block: (rank + 1) * block]
    if collective == "all_to_all":
        return np.concatenate([pattern(r, n_in, dtype)[rank * block: (rank + 1) * block] for r in range(world)])
    if collective == "sendrecv":
        return pattern((rank - 1) % world, n_in, dtype)
    return None


@dataclass
class Buffers:
    """One rank's numpy buffers for one case, and how to reset and check them."""

    template: np.ndarray  # the input as it must be before each step
    inp: np.ndarray
    out: np.ndarray  # empty when the collective works in place
    expect: np.ndarray | None  # the expectation (reductions of floats: in float64)
    rtol: float  # floating-point results may differ from float64 by rounding
    exact: np.ndarray | None  # ``expect`` in the checked dtype (NaN where that overflows)
    same: np.ndarray  # the check's verdicts, one piece at a time (bools)
    shared: bool = False  # inp and out from chorus.empty_shared (--registered)

    @property
    def checked(self) -> np.ndarray:
        return self.inp if self.out.size == 0 else self.out

    def clone(self) -> Buffers:
        """Buffers of their own for another op of the same batch (the expectation is shared),
        from the same allocator."""
        copy = _shared_copy if self.shared else np.copy
        return Buffers(self.template, copy(self.template), copy(np.zeros_like(self.out)), self.expect, self.rtol,
                       self.exact, self.same, self.shared)

    def reset(self) -> None:
        self.inp[...] = self.template

    def check(self) -> int:
        """The number of wrong elements in the checked buffer.

        It runs between timed ops, so it allocates nothing and reads little: each piece
        is first compared with ``exact``, the expectation in the buffer's own dtype (sums
        of the patterns' small integers are exact); only a piece with a difference is
        compared again with the tolerance (``rtol`` against ``expect``), which counts.
        Not ``np.isclose`` in float64 on every piece: its temporaries would push the next
        op's buffers out of the caches, and the timed op after each check would pay for
        the misses."""
        if self.expect is None:
            return 0
        got, wrong = self.checked, 0
        for lo in range(0, got.size, _CHECK_ELEMS):
            part = got[lo: lo + _CHECK_ELEMS]
            same = self.same[: part.size]
            np.equal(part, self.exact[lo: lo + _CHECK_ELEMS], out=same)
            if np.count_nonzero(same) < part.size:
                wrong += self._count_wrong(part, self.expect[lo: lo + _CHECK_ELEMS])
        return wrong

    def _count_wrong(self, part: np.ndarray, want: np.ndarray) -> int:
        """Wrong elements of one piece, within the tolerance (NaN where NaN is expected is right)."""
        if self.rtol == 0.0:
            return int(np.count_nonzero(part != want.astype(part.dtype)))
        ok = np.isclose(part.astype(np.float64), want, rtol=self.rtol, atol=0.0, equal_nan=True)
        return int(part.size - np.count_nonzero(ok))


def _exact(expect: np.ndarray | None, dtype: str) -> np.ndarray | None:
    """``expect`` in ``dtype``; NaN where that cast overflows (the tolerance decides there)."""
    if expect is None:
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        exact = expect.astype(dtype)
    if exact.dtype.kind == "f":
        exact[np.isinf(exact) & ~np.isinf(expect)] = np.nan
    return exact


def _shared_copy(values: np.ndarray) -> np.ndarray:
    """A copy of ``values`` in a registered buffer (chorus.empty_shared).  Imported here:
    only ``--registered`` needs chorus.shm, so a chorus without it still benches."""
    from chorus.shm import registered

    fresh = registered.empty_shared(values.shape, values.dtype)
    fresh[...] = values
    return fresh


def make_buffers(collective: str, size_elems: int, dtype: str, rank: int, world: int,
                 op: str = "sum", registered_buffers: bool = False) -> Buffers:
    """``registered_buffers``: input and output from chorus.empty_shared (``--registered``)."""
    n_in, n_out = counts(collective, size_elems, world)
    template = pattern(rank, n_in, dtype)
    expect = expected(collective, rank, world, n_in, n_out, dtype, op)
    # Floats: inputs are small integers, so sums are exact until float16 runs out of
    # digits; products and averages round.  A tolerance of a few ulps per rank still
    # catches any misplaced or missing contribution (off by >= 1/15).
    rtol = 4.0 * world * float(np.finfo(dtype).eps) if np.dtype(dtype).kind == "f" else 0.0
    inp, out = template.copy(), np.zeros(n_out, dtype)
    if registered_buffers:
        inp, out = _shared_copy(inp), _shared_copy(out)
    same = np.empty(min(_CHECK_ELEMS, max(n_in, n_out)), bool)
    return Buffers(template, inp, out, expect, rtol, _exact(expect, dtype), same, registered_buffers)


Case = tuple[Callable[[], None], Callable[[], Any], Callable[[], int]]


def batch_size(collective: str, size_elems: int, dtype: str, world: int, iters: int) -> int:
    """Ops per timed batch for this size: as many as ``iters`` whose buffers fit ``BATCH_BYTES``."""
    n_in, n_out = counts(collective, size_elems, world)
    per_op = max(1, (2 * n_in + n_out) * np.dtype(dtype).itemsize)
    return max(1, min(iters, BATCH_BYTES // per_op))


def make_batch(collective: str, size_elems: int, dtype: str, rank: int, world: int, op: str,
               copies: int, registered_buffers: bool = False) -> list[Buffers]:
    """``copies`` sets of buffers for one size (one per op of a batch)."""
    first = make_buffers(collective, size_elems, dtype, rank, world, op, registered_buffers)
    return [first, *(first.clone() for _ in range(copies - 1))]


def make_cases(api: Any, lib: str, collective: str, size_elems: int, dtype: str, rank: int,
               world: int, op: str = "sum", copies: int = 1, registered: bool = False) -> list[Case]:
    """One ``(reset, step, check)`` per op of a batch (see :func:`make_case`); ``registered``:
    buffers from chorus.empty_shared."""
    return [make_case(api, lib, collective, bufs, rank, world, op)
            for bufs in make_batch(collective, size_elems, dtype, rank, world, op, copies, registered)]


def make_case(api: Any, lib: str, collective: str, bufs: Buffers, rank: int, world: int,
              op: str = "sum") -> Case:
    """``(reset, step, check)`` on ``bufs`` for a library with the torch.distributed API:
    ``lib`` is "chorus" (numpy arrays) or "gloo" (torch tensors sharing their memory)."""
    inp, out = _tensor(lib, bufs.inp), _tensor(lib, bufs.out)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    rop = getattr(api.ReduceOp, OPS[op])
    steps: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: api.all_reduce(inp, op=rop),
        "broadcast": lambda: api.broadcast(inp, src=0),
        "reduce": lambda: api.reduce(inp, dst=0, op=rop),
        "all_gather": lambda: api.all_gather_into_tensor(out, inp),
        "reduce_scatter": lambda: api.reduce_scatter_tensor(out, inp, op=rop),
        "all_to_all": lambda: api.all_to_all_single(out, inp),
        "barrier": lambda: api.barrier(),
        "sendrecv": lambda: [w.wait() for w in (api.irecv(out, src=prv), api.isend(inp, dst=nxt))],
    }
    return bufs.reset, steps[collective], bufs.check


def scaled(n: int, nbytes: int, floor: int) -> int:
    """``n`` iterations up to 1 MiB; above, ``n`` x 1 MiB / size (at least ``floor``), so a
    sweep to 256 MiB takes seconds, not minutes (``--scale-iters``)."""
    return n if nbytes <= 1 << 20 else max(floor, n * (1 << 20) // nbytes)


def iterations(cfg: dict, collective: str, count: int, dtype: str, world: int) -> tuple[int, int]:
    """(timed, warm-up) iterations for one size of a sweep configured by ``cfg``."""
    if not cfg.get("scale_iters"):
        return cfg["iters"], cfg["warmup"]
    nbytes = max(counts(collective, count, world)) * np.dtype(dtype).itemsize
    return scaled(cfg["iters"], nbytes, 5), scaled(cfg["warmup"], nbytes, min(1, cfg["warmup"]))


def time_case(barrier: Callable[[], Any], cases: list[Case], iters: int, warmup: int) -> tuple[float, int]:
    """Mean seconds per op over ``iters`` ops run back to back in batches of ``len(cases)``
    (each op on its own buffers: reset before its batch, checked after it, both untimed;
    a barrier between the resets and the timed ops, so that no rank's time includes
    waiting for another rank's reset or check), and the total number of wrong elements
    on this rank."""
    reset, step, _ = cases[0]
    for _ in range(warmup):
        reset()
        step()
    barrier()
    total, wrong, done = 0.0, 0, 0
    while done < iters:
        batch = cases[: iters - done]
        for reset, _, _ in batch:
            reset()
        barrier()  # every rank starts the batch together, its reset and the last check done
        start = time.perf_counter()
        for _, step, _ in batch:
            step()
        total += time.perf_counter() - start
        for _, _, check in batch:
            wrong += check()
        done += len(batch)
    barrier()
    return total / max(iters, 1), wrong


def _tensor(lib: str, arr: np.ndarray) -> Any:
    if lib == "chorus":
        return arr
    import torch

    return torch.from_numpy(arr)
