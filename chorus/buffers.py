"""Turn what users pass as tensors into flat byte buffers, without copying when possible.

Accepted: numpy arrays, torch CPU tensors and torch CUDA tensors (recognised by duck
typing: torch is never imported here; when a tensor is passed, torch is already in
``sys.modules``).  A CUDA tensor's buffer is a flat torch tensor on its device (its
``device`` is ``"cuda"``): the CUDA component (chorus.cuda) moves it.

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

    ``array``: 1-D contiguous numpy view/copy (``uint16`` holding bfloat16 bits for bf16),
    or, for a CUDA tensor, a 1-D contiguous torch tensor on its device (bfloat16 as is);
    ``dtype``: the dtype name on the wire; ``source``: the user's object; ``device``:
    ``"cpu"`` or ``"cuda"``.
    """

    array: Any
    dtype: str
    source: Any
    copied: bool = False
    is_torch: bool = False
    device: str = "cpu"

    @property
    def numel(self) -> int:
        return self.array.size if self.device == "cpu" else self.array.numel()

    @property
    def writable(self) -> bool:
        return self.device != "cpu" or self.array.flags.writeable

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
        if self.device != "cpu":
            self.source.copy_(self.array.view(self.source.shape))  # on the current stream
        elif self.is_torch:
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
        f"{op}: {what} must be a numpy.ndarray or a torch.Tensor (CPU or CUDA), got {describe(obj)}"
    )


def dtype_name_of(obj: Any) -> str:
    """The wire dtype name of a numpy array or torch tensor."""
    if isinstance(obj, np.ndarray):
        return obj.dtype.name
    return str(obj.dtype).removeprefix("torch.")


#: dtypes only the CUDA component moves (never on the wire)
DEVICE_ONLY_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"})


def _check_dtype(name: str, op: str, what: str, device: str = "cpu") -> None:
    if device == "cpu" and name in DEVICE_ONLY_DTYPES:
        raise InvalidTensorError(f"{op}: {what} is a CPU tensor of {name}, which chorus moves only on "
                                 "CUDA; pass it on a GPU or as another dtype")
    if name not in DTYPE_CODES or name == "bytes":
        supported = ", ".join(n for n in DTYPE_CODES if n != "bytes")
        raise InvalidTensorError(f"{op}: {what} has dtype {name}, which chorus cannot send; supported: {supported}")


# numpy's dtype.name is slow (~9 us); a dict lookup on the dtype object is not.
_NUMPY_NAMES = {np.dtype(name): name for name in DTYPE_CODES
                if name not in ("bytes", "bfloat16") and not name.startswith("float8")}


def _numpy_buffer(arr: np.ndarray, op: str, what: str) -> Buffer:
    name = _NUMPY_NAMES.get(arr.dtype) or arr.dtype.name
    _check_dtype(name, op, what)
    if arr.flags.c_contiguous:
        return Buffer(arr.reshape(-1), name, arr)
    return Buffer(np.ascontiguousarray(arr).reshape(-1), name, arr, copied=True)


def _torch_buffer(t: Any, op: str, what: str) -> Buffer:
    kind = t.device.type
    if kind == "cuda":
        return _cuda_buffer(t, op, what)
    if kind != "cpu":
        raise InvalidTensorError(
            f"{op}: {what} is on device {t.device}; chorus moves CPU and CUDA tensors — "
            "move it with .cpu() or .cuda()")
    if t.layout != sys.modules["torch"].strided:
        raise InvalidTensorError(f"{op}: {what} is a {t.layout} tensor; chorus moves dense (strided) "
                                 "tensors: pass .to_dense()")
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


def _cuda_buffer(t: Any, op: str, what: str) -> Buffer:
    name = dtype_name_of(t)
    _check_dtype(name, op, what, "cuda")
    if t.layout != sys.modules["torch"].strided:
        raise InvalidTensorError(f"{op}: {what} is a {t.layout} tensor; pass .to_dense()")
    flat = t.detach()
    copied = not flat.is_contiguous()
    if copied:
        flat = flat.contiguous()  # on the current stream: ordered before the op
    return Buffer(flat.view(-1), name, t, copied=copied, is_torch=True, device="cuda")


def same_device(bufs: list[Buffer], op: str) -> str:
    """The one device of ``bufs``; InvalidTensorError when CPU and CUDA tensors are mixed."""
    devices = {b.device for b in bufs}
    if len(devices) > 1:
        raise InvalidTensorError(f"{op}: tensors on the CPU and on CUDA in one call; pass all on one device")
    return bufs[0].device if bufs else "cpu"


def empty(n: int, like: Any) -> Any:
    """A new flat array of ``n`` elements of ``like``'s dtype, on its device."""
    return np.empty(n, like.dtype) if isinstance(like, np.ndarray) else like.new_empty(n)


def concat(arrays: list, like: Any) -> Any:
    """The flat arrays ``arrays`` end to end (``like``'s empty slice when there are none)."""
    if not arrays:
        return like[:0]
    if isinstance(arrays[0], np.ndarray):
        return np.concatenate(arrays)
    return sys.modules["torch"].cat(arrays)


def clone(array: Any) -> Any:
    """A copy of ``array`` (numpy or torch)."""
    return array.copy() if isinstance(array, np.ndarray) else array.clone()
