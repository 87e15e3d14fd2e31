"""``ReduceOp`` and the element-wise kernels that combine two buffers in place.

    ReduceOp.SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, AVG, PREMUL_SUM (via
    ``_make_nccl_premul_sum(factor)``), as in torch.distributed.

Which ops each dtype family supports:

    integers      all except AVG (integer division would silently truncate)
    bool          SUM (= or), PRODUCT (= and), MIN (= and), MAX (= or), BAND, BOR, BXOR
    floats        SUM, PRODUCT, MIN, MAX, AVG, PREMUL_SUM
    complex       SUM, PRODUCT, AVG, PREMUL_SUM
    bfloat16      as floats; computed in float32 and rounded back (nearest even)
    float16       as floats; numpy computes each operation in float32 and rounds back

Every kernel is ``combine(dst, src)``: ``dst = op(dst, src)`` element-wise, in place, on
flat numpy arrays (bfloat16 travels as uint16 bit patterns).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from chorus.errors import InvalidArgumentError

# IEEE results are the contract (as in gloo and NCCL): a sum that overflows to inf, or a
# 0/0 that gives nan, is the answer, not something to warn about on every rank and call.
# A filter on the warning's module costs nothing per call (numpy's errstate would cost a
# context switch per reduction); it covers every chorus module that runs a reduction.
warnings.filterwarnings("ignore", message=r"(overflow|invalid value|divide by zero|underflow) encountered",
                        category=RuntimeWarning, module=r"chorus\.")


@dataclass(frozen=True)
class _Op:
    """One reduction.  ``factor`` is set only for PREMUL_SUM made by _make_nccl_premul_sum.
    Its hash is computed once (the lanes' plan caches key on the op every call: a
    dataclass's own __hash__ hashes its fields each time)."""

    name: str
    factor: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.name, self.factor)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return _Op, (self.name, self.factor)  # (the hash of a str differs between processes)

    def __repr__(self) -> str:
        return f"<ReduceOp.{self.name}{'' if self.factor is None else f'({self.factor})'}>"


class ReduceOp:
    """torch.distributed's reduction names: SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, AVG,
    and PREMUL_SUM (made by ``_make_nccl_premul_sum(factor)``).

    rank 0: [1, 5]   rank 1: [3, 2]   --all_reduce(t, op=ReduceOp.MAX)-->   both: [3, 5]
    rank 0: [1., 5.]   rank 1: [3., 2.]   --all_reduce(t, op=ReduceOp.AVG)-->   both: [2., 3.5]

    Integers take every op but AVG; bool takes SUM (or), PRODUCT (and), MIN, MAX and the
    bitwise ones; floats take SUM, PRODUCT, MIN, MAX, AVG and PREMUL_SUM; complex numbers
    SUM, PRODUCT, AVG and PREMUL_SUM.
    """

    SUM = _Op("SUM")
    PRODUCT = _Op("PRODUCT")
    MIN = _Op("MIN")
    MAX = _Op("MAX")
    BAND = _Op("BAND")
    BOR = _Op("BOR")
    BXOR = _Op("BXOR")
    AVG = _Op("AVG")
    PREMUL_SUM = _Op("PREMUL_SUM")
    RedOpType = _Op


def make_premul_sum(factor: float) -> _Op:
    """A SUM that first multiplies every rank's input by ``factor`` (torch's helper name).

    rank 0: [1., 2.]   rank 1: [3., 4.]   --all_reduce(t, op=_make_nccl_premul_sum(0.5))-->   both: [2., 3.]
    """
    return _Op("PREMUL_SUM", float(factor))


_NUMPY_OPS: dict[str, Callable] = {
    "SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum,
    "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor,
    "AVG": np.add, "PREMUL_SUM": np.add,
}
_BOOL_OPS: dict[str, Callable] = {
    "SUM": np.logical_or, "PRODUCT": np.logical_and, "MIN": np.logical_and, "MAX": np.logical_or,
    "BAND": np.logical_and, "BOR": np.logical_or, "BXOR": np.logical_xor,
}
_FLOAT_OPS = frozenset({"SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"})
_COMPLEX_OPS = frozenset({"SUM", "PRODUCT", "AVG", "PREMUL_SUM"})
_INT_OPS = frozenset({"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"})



#: torch.distributed's name for it
_make_nccl_premul_sum = make_premul_sum

def family(dtype: str) -> str:
    if dtype == "bool":
        return "bool"
    if dtype.startswith("complex"):
        return "complex"
    if dtype.startswith("float") or dtype == "bfloat16":
        return "float"
    return "int"


def check_op(op: _Op, dtype: str, what: str) -> None:
    """Raise InvalidArgumentError if ``op`` cannot reduce ``dtype`` (before anything is sent)."""
    if not isinstance(op, _Op):
        raise InvalidArgumentError(f"{what}: op must be a chorus.ReduceOp member, got {op!r}")
    if op.name == "PREMUL_SUM" and op.factor is None:
        raise InvalidArgumentError(
            f"{what}: ReduceOp.PREMUL_SUM needs a factor; use _make_nccl_premul_sum(factor)")
    allowed = {"bool": _BOOL_OPS.keys(), "complex": _COMPLEX_OPS, "float": _FLOAT_OPS,
               "int": _INT_OPS}[family(dtype)]
    if op.name not in allowed:
        raise InvalidArgumentError(
            f"{what}: ReduceOp.{op.name} is not defined for {dtype} tensors; "
            f"valid for {dtype}: {', '.join(sorted(allowed))}")


def combiner(op: _Op, dtype: str) -> Callable[[np.ndarray, np.ndarray], None]:
    """``combine(dst, src)`` computing ``dst = op(dst, src)`` in place for ``dtype``."""
    if dtype == "bool":
        fn = _BOOL_OPS[op.name]
        return lambda dst, src: fn(dst, src, out=dst)
    fn = _NUMPY_OPS[op.name]
    if dtype == "bfloat16":
        def combine_bf16(dst: np.ndarray, src: np.ndarray) -> None:
            dst[...] = float32_to_bf16(fn(bf16_to_float32(dst), bf16_to_float32(src)))
        return combine_bf16
    return lambda dst, src: fn(dst, src, out=dst)


def row_reducer(op_name: str, dtype: str) -> Callable[[np.ndarray, np.ndarray], None]:
    """``reduce(rows, out)``: ``out = op(rows[0], rows[1], ...)`` over the first axis of a
    2-D array, in one numpy call (shared-memory collectives reduce W slots at once), or
    over a list of equal rows (chorus.shm.mapped: rows in W ranks' buffers).  Two rows
    take one elementwise call, so ``out`` may be either of them (chorus.shm.direct).

    Deterministic: the same rows give the same bits on every rank (the method depends
    only on the shape).  bfloat16 is reduced in float32 and rounded once at the end; AVG
    and PREMUL_SUM reduce as SUM (their scaling runs before/after the collective).
    """
    return _row_reducer(op_name, dtype)


def rows_into(op_name: str, dtype: str, rows: np.ndarray) -> Callable[[np.ndarray], None]:
    """``into(out)``: ``row_reducer(op_name, dtype)(rows, out)`` for rows fixed once (the
    one-shot all_reduce's views of the window), with the same bits.  Two rows of a numpy
    dtype take one ufunc call on prebuilt row views (about a third of the general
    reducer's cost per call: no checks, no dispatch); more rows, shorter than ``_CHAIN_BYTES``, take
    the one reduce call the general reducer would make, without its checks per call;
    everything else is the general reducer."""
    if dtype == "bfloat16":
        return functools.partial(row_reducer(op_name, dtype), rows)
    fn = _BOOL_OPS[op_name] if dtype == "bool" else _NUMPY_OPS[op_name]
    if len(rows) == 2:
        first, second = rows[0, ...], rows[1, ...]  # views, also of 0-d rows (rows[0] would copy)
        return lambda out: fn(first, second, out=out)
    if len(rows) > 2 and rows.nbytes // len(rows) < _CHAIN_BYTES:
        reduce = fn.reduce
        return lambda out: reduce(rows, 0, None, out)  # as reduce_rows does for these rows
    return functools.partial(row_reducer(op_name, dtype), rows)


_CHAIN_BYTES = 64 << 10  # rows this long: pairwise ufunc calls beat ufunc.reduce(axis=0)


@functools.cache
def _row_reducer(op_name: str, dtype: str) -> Callable[[np.ndarray, np.ndarray], None]:
    fn = _BOOL_OPS[op_name] if dtype == "bool" else _NUMPY_OPS[op_name]
    reduce = fn.reduce

    def reduce_rows(rows: np.ndarray, out: np.ndarray) -> None:
        # One reduce call is cheapest for short rows; for long ones numpy's axis-0 reduce
        # runs at a third of the speed of out = a op b (measured: 2 rows of 1 MiB).
        n = len(rows)  # (rows: an array, or a list of rows; the array's row length costs no view)
        if n == 2 or (n > 2 and (rows.nbytes // n if type(rows) is np.ndarray else rows[0].nbytes) >= _CHAIN_BYTES):
            fn(rows[0], rows[1], out=out)
            for row in rows[2:]:
                fn(out, row, out=out)
        else:
            reduce(rows, 0, None, out)  # axis 0, into out (positional: no keyword parsing)

    if dtype == "bfloat16":
        def reduce_bf16(rows: np.ndarray, out: np.ndarray) -> None:
            rows = np.asarray(rows)  # (a list of rows: chorus.shm.mapped)
            wide = np.empty(rows.shape[1], np.float32)
            reduce_rows(bf16_to_float32(rows), wide)
            out[...] = float32_to_bf16(wide)
        return reduce_bf16
    return reduce_rows


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 values (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounding to nearest even (NaN stays NaN)."""
    u = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)  # keep sign, quiet NaN
    return rounded


def scale(data: np.ndarray, dtype: str, factor: float) -> None:
    """``data *= factor`` in place (PREMUL_SUM's pre-multiply); bfloat16 via float32.
    A torch (CUDA) tensor is scaled with torch, on its current stream."""
    if not isinstance(data, np.ndarray):
        data.mul_(factor)
    elif dtype == "bfloat16":
        data[...] = float32_to_bf16(bf16_to_float32(data) * np.float32(factor))
    else:
        np.multiply(data, factor, out=data, casting="unsafe")


def divide(data: np.ndarray, dtype: str, divisor: int) -> None:
    """``data /= divisor`` in place (AVG's final step); bfloat16 via float32.  A torch
    (CUDA) tensor is divided with torch, on its current stream (integers truncate toward
    zero, as numpy's cast does)."""
    if not isinstance(data, np.ndarray):
        if family(dtype) == "float":
            data.div_(divisor)
        else:
            data.copy_(data / divisor)
    elif dtype == "bfloat16":
        data[...] = float32_to_bf16(bf16_to_float32(data) / np.float32(divisor))
    else:
        np.divide(data, divisor, out=data, casting="unsafe")
