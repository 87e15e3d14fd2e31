"""Turn what users pass as tensors into flat byte buffers, without copying when possible.

Accepted: numpy arrays and torch CPU tensors (recognised by duck typing: torch is never
imported here; when a tensor is passed, torch is already in ``sys.modules``).

* contiguous input: a zero-copy view of its memory;
* non-contiguous input: a contiguous copy; for receive buffers the result is copied
  back into the original by :meth:`Buffer.finish`;
* torch ``bfloat16`` (numpy has none) travels as its 16-bit pattern, tagged bfloat16.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from chorus.errors import InvalidTensorError
from chorus.wire.dtypes import DTYPE_CODES


@dataclass(slots=True)
class Buffer:
    """A tensor's data as a flat, contiguous numpy array plus what is needed to write back.

    ``array``: 1-D contiguous numpy view/copy (``uint16`` holding bfloat16 bits for bf16);
    ``dtype``: the dtype name on the wire; ``source``: the user's object.
    """

    array: np.ndarray
    dtype: str
    source: Any
    copied: bool = False
    is_torch: bool = False

    @property
    def numel(self) -> int:
        return self.array.size

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype]

    def bytes_view(self) -> memoryview:
        """The buffer's memory as a writable-if-possible flat ``uint8`` memoryview."""
        return memoryview(self.array.view(np.uint8))

    def finish(self) -> None:
        """Copy received data back into a non-contiguous destination (no-op otherwise)."""
        if not self.copied:
            return
        if self.is_torch:
            torch = sys.modules["torch"]
            src = torch.from_numpy(self.array)
            if self.dtype == "bfloat16":
                src = src.view(torch.bfloat16)
            self.source.copy_(src.view(self.source.shape))
        else:
            self.source[...] = self.array.reshape(self.source.shape)


def is_torch_tensor(obj: Any) -> bool:
    """True for a torch.Tensor, decided without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def describe(obj: Any) -> str:
    """A short description of ``obj`` for error messages."""
    if isinstance(obj, np.ndarray) or is_torch_tensor(obj):
        return f"{type(obj).__name__}(shape={tuple(obj.shape)}, dtype={obj.dtype})"
    return type(obj).__name__


def as_buffer(obj: Any, *, what: str = "tensor", op: str = "op") -> Buffer:
    """Wrap ``obj`` (numpy array or torch CPU tensor) as a :class:`Buffer`.

    Raises InvalidTensorError naming ``op`` and ``what`` for anything else.
    """
    if isinstance(obj, np.ndarray):
        return _numpy_buffer(obj, op, what)
    if is_torch_tensor(obj):
        return _torch_buffer(obj, op, what)
    raise InvalidTensorError(
        f"{op}: {what} must be a numpy.ndarray or a torch.Tensor on the CPU, got {describe(obj)}"
    )


def dtype_name_of(obj: Any) -> str:
    """The wire dtype name of a numpy array or torch tensor."""
    if isinstance(obj, np.ndarray):
        return obj.dtype.name
    return str(obj.dtype).removeprefix("torch.")


def _check_dtype(name: str, op: str, what: str) -> None:
    if name not in DTYPE_CODES or name == "bytes":
        supported = ", ".join(n for n in DTYPE_CODES if n != "bytes")
        raise InvalidTensorError(f"{op}: {what} has dtype {name}, which chorus cannot send; supported: {supported}")


# numpy's dtype.name is slow (~9 us); a dict lookup on the dtype object is not.
_NUMPY_NAMES = {np.dtype(name): name for name in DTYPE_CODES if name not in ("bytes", "bfloat16")}


def _numpy_buffer(arr: np.ndarray, op: str, what: str) -> Buffer:
    name = _NUMPY_NAMES.get(arr.dtype) or arr.dtype.name
    _check_dtype(name, op, what)
    if arr.flags.c_contiguous:
        return Buffer(arr.reshape(-1), name, arr)
    return Buffer(np.ascontiguousarray(arr).reshape(-1), name, arr, copied=True)


def _torch_buffer(t: Any, op: str, what: str) -> Buffer:
    if t.device.type != "cpu":
        raise InvalidTensorError(
            f"{op}: {what} is on device {t.device}; chorus handles CPU tensors for now — "
            "move it with .cpu() or use the nccl backend of torch.distributed for GPU tensors"
        )
    name = dtype_name_of(t)
    _check_dtype(name, op, what)
    torch = sys.modules["torch"]
    flat = t.detach()
    copied = not flat.is_contiguous()
    if copied:
        flat = flat.contiguous()
    if name == "bfloat16":
        flat = flat.view(torch.int16)
    arr = flat.numpy().reshape(-1)
    if name == "bfloat16":
        arr = arr.view(np.uint16)
    return Buffer(arr, name, t, copied=copied, is_torch=True)
