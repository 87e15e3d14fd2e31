"""A kernel that reads peers' memory through its own loads, written in PTX and loaded
through the CUDA driver, so that the workspace's check compiles nothing.

The workspace's check (chorus.cuda.workspace) proves that this process's kernels can
load from every peer's mapped workspace, the way chorus's all_reduce kernels do.  Made
with Triton, that kernel cost a group's first set-up 1.7 s of compilation on an empty
Triton cache (docs/results/4xh200/check-5b63e6f/setup-cold.log), for a kernel no user op
runs.  The driver turns these few PTX lines into the GPU's code in milliseconds.

    sum_rows(rows, out, width, stream)

    rows:  device address of ``world`` 64-bit addresses, rank r's row of int64 words
    out:   device address of ``width`` int64 words
    after: out[j] = sum over r of rows[r][j], for j < width (read with volatile loads
           through each row's address as this process maps it)

Each thread sums one column; one block of up to 1024 threads serves any width the check
asks for (the group's world size).
"""

from __future__ import annotations

import ctypes
import threading

from chorus.cuda.direct import libcuda

#: threads of the one block (the widths the check asks for: a host's GPUs)
MAX_WIDTH = 1024

#: sum_rows in PTX: ISA 6.0 for sm_60 and later, which every GPU chorus's kernels run on
#: accepts (the driver compiles it for the GPU at hand)
PTX = b"""
.version 6.0
.target sm_60
.address_size 64

.visible .entry chorus_sum_rows(
    .param .u64 rows,
    .param .u64 out,
    .param .u32 width
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<4>;
    .reg .b64 %rd<11>;

    ld.param.u64 %rd1, [rows];
    ld.param.u64 %rd2, [out];
    ld.param.u32 %r1, [width];
    mov.u32 %r2, %tid.x;
    setp.ge.u32 %p1, %r2, %r1;
    @%p1 bra DONE;
    mul.wide.u32 %rd3, %r2, 8;
    mov.u64 %rd4, 0;
    mov.u32 %r3, 0;
NEXT_ROW:
    mul.wide.u32 %rd5, %r3, 8;
    add.s64 %rd6, %rd1, %rd5;
    ld.u64 %rd7, [%rd6];
    add.s64 %rd8, %rd7, %rd3;
    ld.volatile.u64 %rd9, [%rd8];
    add.s64 %rd4, %rd4, %rd9;
    add.u32 %r3, %r3, 1;
    setp.lt.u32 %p2, %r3, %r1;
    @%p2 bra NEXT_ROW;
    add.s64 %rd10, %rd2, %rd3;
    st.u64 [%rd10], %rd4;
DONE:
    ret;
}
""" + b"\0"

NAME = b"chorus_sum_rows"


class PeerSumError(RuntimeError):
    """The kernel could not be launched (the driver's CUresult in the text)."""


class PeerSumUnavailable(PeerSumError):
    """The kernel cannot be loaded in this process: no libcuda, or a driver that compiles
    no PTX (``CUDA_DISABLE_PTX_JIT=1``, a container without the driver's PTX compiler)."""


_LOCK = threading.Lock()
_FUNCTIONS: dict[int, int] = {}  # CUcontext -> CUfunction (a module stays loaded for the process)


def _call(lib, name: str, *args, error: type[PeerSumError] = PeerSumError) -> None:
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    err = fn(*args)
    if err != 0:
        raise error(f"{name} failed: CUresult {err}")


def _function(lib) -> int:
    """The kernel in the calling thread's current context (loaded at its first use there)."""
    ctx = ctypes.c_void_p()
    _call(lib, "cuCtxGetCurrent", ctypes.byref(ctx))
    if not ctx.value:
        raise PeerSumError("no CUDA context is current on this thread (make the group's device current first)")
    with _LOCK:
        function = _FUNCTIONS.get(ctx.value)
        if function is None:
            module, fn = ctypes.c_void_p(), ctypes.c_void_p()
            _call(lib, "cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(PTX), error=PeerSumUnavailable)
            _call(lib, "cuModuleGetFunction", ctypes.byref(fn), module, ctypes.c_char_p(NAME),
                  error=PeerSumUnavailable)
            function = _FUNCTIONS[ctx.value] = fn.value
    return function


def sum_rows(rows: int, out: int, width: int, stream: int) -> None:
    """Enqueue out[j] = sum_r rows[r][j] for j < width on ``stream`` (a raw
    cudaStream_t) of the current context; ``rows`` holds ``width`` row addresses.
    PeerSumUnavailable: nothing was enqueued, and the kernel will not load here."""
    if not 0 < width <= MAX_WIDTH:
        raise ValueError(f"sum_rows: width {width} is outside 1..{MAX_WIDTH}")
    lib = libcuda()
    if lib is None:
        raise PeerSumUnavailable("libcuda.so.1 does not load in this process")
    function = _function(lib)
    values = (ctypes.c_uint64(rows), ctypes.c_uint64(out), ctypes.c_uint32(width))
    params = (ctypes.c_void_p * 3)(*(ctypes.addressof(v) for v in values))
    one = ctypes.c_uint(1)
    _call(lib, "cuLaunchKernel", ctypes.c_void_p(function), one, one, one, ctypes.c_uint(width), one, one,
          ctypes.c_uint(0), ctypes.c_void_p(stream), params, ctypes.c_void_p(None))
