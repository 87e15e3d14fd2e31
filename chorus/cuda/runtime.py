"""The few CUDA runtime calls chorus.cuda makes itself (through cuda-bindings), and raw
device addresses seen as arrays.

Everything else goes through torch (streams, events, tensors on the caller's device) or
Triton (kernels).  cuda-bindings is imported on first use: ``from cuda.bindings import
runtime`` (cuda-bindings 12.6 and later) or ``from cuda import cudart`` (older).

Each call checks its error code and raises :class:`CudaError` naming the call; nothing
here exits the process.
"""

from __future__ import annotations

import ctypes
import functools


class CudaError(RuntimeError):
    """A CUDA runtime call failed (the message names it and the error)."""


@functools.cache
def cudart():
    """The cuda-bindings runtime module (ImportError with what to install if absent)."""
    try:
        from cuda.bindings import runtime
        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart as runtime
        return runtime
    except ImportError:
        raise ImportError("chorus.cuda needs cuda-bindings: pip install 'chorus[cuda]' "
                          "(or pip install cuda-bindings)") from None


def _check(result, what: str):
    """Unpack a cuda-bindings result tuple ``(err, *values)``; raise CudaError on failure."""
    rt = cudart()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        name = rt.cudaGetErrorName(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        raise CudaError(f"{what} failed: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# -- device memory and IPC -----------------------------------------------------------------
def malloc(nbytes: int) -> int:
    """``cudaMalloc`` on the current device (not torch's caching allocator: an IPC handle
    must name the start of its own allocation)."""
    return int(_check(cudart().cudaMalloc(nbytes), f"cudaMalloc({nbytes})"))


def free(ptr: int) -> None:
    _check(cudart().cudaFree(ptr), "cudaFree")


def ipc_handle(ptr: int) -> bytes:
    """The IPC handle of the allocation starting at ``ptr`` (64 bytes)."""
    handle = _check(cudart().cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
    raw = handle.reserved  # bytes, or a sequence of (possibly signed) chars, by version
    return raw if isinstance(raw, bytes) else bytes(b & 0xFF for b in raw)


def ipc_open(handle: bytes) -> int:
    """Map a peer's allocation into this process (peer access enabled lazily); its address."""
    rt = cudart()
    h = rt.cudaIpcMemHandle_t()
    try:
        h.reserved = handle
    except (TypeError, ValueError):
        h.reserved = list(handle)
    return int(_check(rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess),
                      "cudaIpcOpenMemHandle"))


def ipc_close(ptr: int) -> None:
    _check(cudart().cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")


def current_device() -> int:
    return int(_check(cudart().cudaGetDevice(), "cudaGetDevice"))


# -- pinned host memory that kernels read and write (abort and status words) ----------------
def host_alloc(nbytes: int) -> int:
    """Page-locked host memory mapped into every device's address space (UVA: kernels use
    the host address as is)."""
    rt = cudart()
    flags = rt.cudaHostAllocMapped | rt.cudaHostAllocPortable
    return int(_check(rt.cudaHostAlloc(nbytes, flags), "cudaHostAlloc"))


def host_free(ptr: int) -> None:
    _check(cudart().cudaFreeHost(ptr), "cudaFreeHost")


def host_words(ptr: int, count: int) -> memoryview:
    """``count`` int64 words at host address ``ptr`` (no copy), read and written as Python
    ints: an element costs a fifth of a numpy array's (every CUDA op reads two)."""
    return memoryview((ctypes.c_int64 * count).from_address(ptr)).cast("B").cast("q")


# -- copies on a stream --------------------------------------------------------------------
def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Copy ``nbytes`` between any two device (or mapped) addresses on ``stream``, by the
    copy engines (cudaMemcpyDefault: unified addressing finds each side's device)."""
    rt = cudart()
    _check(rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDefault, stream),
           "cudaMemcpyAsync")


class DeviceArray:
    """``nbytes`` of device memory at ``ptr`` as a 1-D uint8 array for
    ``torch.as_tensor`` (``__cuda_array_interface__``).  torch reads the device from the
    pointer, so use it for memory that lives on the caller's device (its own workspace)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


# -- events: a point on one stream that another stream (or the host) waits for ---------------
def event_create():
    """A cudaEvent_t without timing (the cheapest to record and to wait for)."""
    rt = cudart()
    return _check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")


def event_destroy(event) -> None:
    _check(cudart().cudaEventDestroy(event), "cudaEventDestroy")


def event_record(event, stream: int) -> None:
    """``event`` marks the work queued on ``stream`` so far."""
    _check(cudart().cudaEventRecord(event, stream), "cudaEventRecord")


def stream_wait_event(stream: int, event) -> None:
    """Work queued on ``stream`` from now on runs after ``event``'s work."""
    _check(cudart().cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent")
