"""A compiled Triton kernel launched through the CUDA driver's ``cuLaunchKernel`` (libcuda
through ctypes), its parameter block laid out once.

Triton's own launcher object re-reads the kernel's metadata, allocates (empty) scratch
and parses every argument in C on every call: 6.7 us of CPU per launch on a 4 x H200
host, about as much as all of chorus's Python around it
(docs/results/4xh200/unheld-lane/lane-nodirect-rank0.txt).  A chorus kernel's launches differ only
in their integer arguments, so the parameter block's layout can be fixed once per
compiled kernel:

    launcher = DirectLaunch.of(compiled, num_warps)   # None: launch through Triton instead
    launcher(grid, stream, args)                      # args: every parameter, constexprs too
    block = launcher.block(args)                      # a block of its own, for repeated
    block.values[block.slot[i]] = v; block(grid, s)   # launches that change a few arguments

A value out of its parameter's range raises LaunchFailed before anything is enqueued
(Triton then specialises the kernel for it); so does a launch the driver finds invalid.
Launches bypass Triton's launch hooks (``launch_enter_hook``: its profilers' records).

``of`` accepts a kernel only when everything it relies on is checked against the
compiled kernel itself: the parameters Triton passes are the non-constexpr ones of its
signature, each an integer (chorus passes addresses as integers), followed by Triton's
scratch pointers (NULL: no scratch); the count and byte size of every parameter agree
with what the driver reports for the function (``cuFuncGetParamInfo``, CUDA 12.4); one
CTA per cluster, no cooperative or programmatic-dependent launch.  Anything else
(another Triton, an older driver, no libcuda) answers None and the caller keeps Triton's
launcher.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import struct
import threading

#: bytes of each integer parameter type of a Triton signature
_SIZES = {"i1": 1, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8}
#: struct codes for an 8-byte slot holding each, padded (a value out of its type's range
#: raises struct.error instead of reaching the kernel truncated)
_CODES = {"i1": "b7x", "i8": "b7x", "u8": "B7x", "i16": "h6x", "u16": "H6x", "i32": "i4x", "u32": "I4x",
          "i64": "q", "u64": "Q"}
#: the scratch pointers Triton appends to a kernel's parameters, by the metadata field that
#: sizes each (NULL when the size is 0)
_SCRATCH = ("global_scratch_size", "profile_scratch_size")
_SUCCESS, _INVALID_VALUE, _INVALID_CONTEXT = 0, 1, 201


class LaunchFailed(RuntimeError):
    """The direct launch cannot take these arguments (nothing was enqueued): one does not
    fit its parameter, or the driver found the parameters invalid.  The caller launches
    through Triton, which specialises the kernel for them."""


class DriverError(RuntimeError):
    """cuLaunchKernel failed for a reason of the device's or context's (an earlier
    kernel's fault, a context of another device current): Triton's launcher would fail
    the same way, so the error is raised."""


class Driver:
    """The libcuda entry points a direct launch needs, typed."""

    def __init__(self, lib):
        self.launch = lib.cuLaunchKernel
        self.launch.restype = ctypes.c_int
        self.launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        # the same entry point untyped, for Block's calls with ready-made ctypes arguments:
        # no conversion per argument (1.7 against 3.0 us per call of an 11-argument C
        # function on a 2-vCPU VM; the typed one converts every Python int each call)
        try:
            self.launch_ready = lib["cuLaunchKernel"]
            self.launch_ready.restype = ctypes.c_int
        except (TypeError, KeyError, AttributeError):
            self.launch_ready = self.launch
        self.param_info = getattr(lib, "cuFuncGetParamInfo", None)  # (CUDA 12.4 and later)
        if self.param_info is not None:
            self.param_info.restype = ctypes.c_int
            self.param_info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                                        ctypes.POINTER(ctypes.c_size_t)]
        self._get_context, self._set_context = lib.cuCtxGetCurrent, lib.cuCtxSetCurrent
        self._get_context.restype = self._set_context.restype = ctypes.c_int
        self._get_context.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._set_context.argtypes = [ctypes.c_void_p]

    def current_context(self) -> int:
        """The calling thread's current CUcontext (0: none)."""
        ctx = ctypes.c_void_p()
        return (ctx.value or 0) if self._get_context(ctypes.byref(ctx)) == _SUCCESS else 0

    def make_current(self, ctx: int) -> bool:
        return bool(ctx) and self._set_context(ctx) == _SUCCESS

    def param_sizes(self, function: int) -> list[int] | None:
        """The byte size of each parameter of the CUfunction ``function``, as the driver
        knows them (None: this driver cannot tell)."""
        if self.param_info is None:
            return None
        offset, size, sizes = ctypes.c_size_t(), ctypes.c_size_t(), []
        for index in range(4096):
            err = self.param_info(function, index, ctypes.byref(offset), ctypes.byref(size))
            if err != _SUCCESS:
                return sizes if err == _INVALID_VALUE else None
            sizes.append(size.value)
        return None


@functools.cache
def libcuda() -> ctypes.CDLL | None:
    """This process's CUDA driver library, or None where it does not load."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


@functools.cache
def _driver() -> Driver | None:
    lib = libcuda()
    try:
        return None if lib is None else Driver(lib)
    except AttributeError:  # (a driver without these entry points)
        return None


def layout(signature: list[str], sizes: list[int], extra: int) -> tuple[list[int], str, int] | None:
    """(indices of the arguments the kernel takes, the struct format of their 8-byte
    slots, how many NULL pointers follow them) for a Triton ``signature`` (each
    parameter's type, constexprs included, in order) and ``extra`` scratch pointers after
    them, against the driver's parameter ``sizes``; None where they do not agree or a
    type is not an integer one."""
    taken = [i for i, kind in enumerate(signature) if kind != "constexpr"]
    if not taken or any(signature[i] not in _SIZES for i in taken):
        return None
    if len(sizes) != len(taken) + extra or any(s != 8 for s in sizes[len(taken):]):
        return None
    if [_SIZES[signature[i]] for i in taken] != sizes[:len(taken)]:
        return None
    return taken, "<" + "".join(_CODES[signature[i]] for i in taken) + "Q" * extra, extra


def _signature(compiled) -> list[str] | None:
    sig = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(sig, dict):
        return None
    kinds = [v if isinstance(v, str) else None for v in sig.values()]
    return None if None in kinds else kinds


def _plain(metadata) -> bool:
    """A launch of one CTA per cluster, no cooperative or PDL launch, no scratch."""
    if getattr(metadata, "num_ctas", 1) != 1:
        return False
    if any(int(d) != 1 for d in (getattr(metadata, "cluster_dims", None) or (1, 1, 1))):
        return False
    if getattr(metadata, "launch_cooperative_grid", False) or getattr(metadata, "launch_pdl", False):
        return False
    return not getattr(metadata, "global_scratch_size", 0) and not getattr(metadata, "profile_scratch_size", 0)


def _failed(err: int) -> Exception:
    if err == _INVALID_VALUE:
        return LaunchFailed(f"cuLaunchKernel found the parameters invalid (CUresult {err})")
    return DriverError(f"cuLaunchKernel failed: CUresult {err} (a CUDA error of the device or context; the "
                       f"same launch through Triton fails too)")


class Block:
    """A parameter block of one kernel's launches: ``values`` (one 8-byte slot per
    parameter; an argument's slot is ``slot[i]``, i its index among the kernel's
    arguments) is what the next call launches with.  The driver's other arguments are
    kept as ctypes objects, made again only when the grid or the stream changes."""

    def __init__(self, launcher: DirectLaunch, args: tuple):
        n = launcher.nparams
        self.values = (ctypes.c_int64 * n)()
        self.slot = launcher.slot
        launcher.pack(self.values, args)
        self._pointers = (ctypes.c_void_p * n)(*(ctypes.addressof(self.values) + 8 * p for p in range(n)))
        self._launch = launcher.driver.launch_ready
        one = ctypes.c_uint(1)
        # (function, grid x, y, z, block x, y, z, shared bytes, stream, parameters, extra)
        self._fixed = (ctypes.c_void_p(launcher.function), one, one, ctypes.c_uint(launcher.threads), one, one,
                       ctypes.c_uint(launcher.shared))
        self._params = ctypes.c_void_p(ctypes.addressof(self._pointers))
        self._ready: tuple = (None, None, ())  # (grid, stream, the driver's arguments for them)
        self._launcher = launcher

    def _arguments(self, grid: int, stream: int) -> tuple:
        ready = self._ready
        if ready[0] != grid or ready[1] != stream:
            f = self._fixed
            ready = self._ready = (grid, stream, (f[0], ctypes.c_uint(grid), *f[1:], ctypes.c_void_p(stream),
                                                  self._params, None))
        return ready[2]

    def __call__(self, grid: int, stream: int) -> None:
        arguments = self._arguments(grid, stream)
        err = self._launch(*arguments)
        if err:
            # a thread with no context current (one that never touched CUDA): the context
            # the kernel was loaded in, as Triton's launcher makes one current, then again
            if err == _INVALID_CONTEXT and self._launcher.driver.make_current(self._launcher.context):
                err = self._launch(*arguments)
            if err:
                raise _failed(err)


class DirectLaunch:
    """``cuLaunchKernel`` of one compiled kernel.  Its own calls share one parameter block
    under a lock; ``block(args)`` makes one for a caller that serialises its launches."""

    def __init__(self, driver: Driver, function: int, threads: int, shared: int, taken: list[int], fmt: str,
                 extra: int, context: int = 0):
        self.driver, self.function, self.threads, self.shared = driver, function, threads, shared
        self.context = context  # (where the kernel was loaded: its first launch's thread's)
        self.nparams = len(taken) + extra
        self.slot = {i: p for p, i in enumerate(taken)}
        self._pick = operator.itemgetter(*taken) if len(taken) > 1 else (lambda args, i=taken[0]: (args[i],))
        self._struct = struct.Struct(fmt)
        self._nulls = (0,) * extra
        self._shared_block = Block(self, (0,) * (max(taken) + 1))
        self._lock = threading.Lock()

    @classmethod
    def of(cls, compiled, num_warps: int) -> DirectLaunch | None:
        """The direct launch of ``compiled`` (a Triton CompiledKernel just launched on
        this thread), or None."""
        try:
            return cls._of(compiled, num_warps)
        except Exception:  # noqa: BLE001 - anything unforeseen: Triton's launcher (the kernel already ran)
            return None

    @classmethod
    def _of(cls, compiled, num_warps: int) -> DirectLaunch | None:
        driver = _driver()
        signature = _signature(compiled)
        metadata = getattr(compiled, "metadata", None)
        function = getattr(compiled, "function", None)
        if driver is None or signature is None or metadata is None or not isinstance(function, int) or not function:
            return None
        if not _plain(metadata) or getattr(metadata, "num_warps", num_warps) != num_warps:
            return None
        sizes = driver.param_sizes(function)
        extra = sum(hasattr(metadata, field) for field in _SCRATCH)
        fixed = None if sizes is None else layout(signature, sizes, extra)
        if fixed is None:
            return None
        taken, fmt, extra = fixed
        return cls(driver, function, 32 * num_warps, int(getattr(metadata, "shared", 0)), taken, fmt, extra,
                   driver.current_context())

    def block(self, args: tuple) -> Block:
        return Block(self, args)

    def __call__(self, grid: int, stream: int, args: tuple) -> None:
        if grid <= 0:  # (as Triton: nothing to launch)
            return
        block = self._shared_block
        with self._lock:
            self.pack(block.values, args)
            block(grid, stream)

    def pack(self, values, args: tuple) -> None:
        """Write ``args``' kernel arguments (and the NULL scratch) into the block ``values``;
        LaunchFailed (nothing launched) where one does not fit its parameter."""
        try:
            self._struct.pack_into(values, 0, *self._pick(args), *self._nulls)
        except struct.error as exc:
            raise LaunchFailed(f"an argument does not fit its parameter: {exc}") from None
