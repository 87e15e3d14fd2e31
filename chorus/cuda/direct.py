"""A compiled Triton kernel launched through the CUDA driver's ``cuLaunchKernel`` (libcuda
through ctypes), its parameter block laid out once.

Triton's own launcher object re-reads the kernel's metadata, allocates (empty) scratch
and parses every argument in C on every call: about 10 us of CPU per launch on a server
core, as much as all of chorus's Python around it.  A chorus kernel's launches differ only
in their integer arguments, so the parameter block's layout can be fixed once per
compiled kernel:

    launcher = DirectLaunch.of(compiled, num_warps)   # None: launch through Triton instead
    launcher(grid, stream, args)                      # args: every parameter, constexprs too
    block = launcher.block(args)                      # a block of its own, for repeated
    block.values[block.slot[i]] = v; block(grid, s)   # launches that change a few arguments

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
#: struct codes for an 8-byte slot holding each (little-endian: the low bytes are the value)
_CODES = {"i1": "q", "i8": "q", "i16": "q", "i32": "q", "i64": "q", "u8": "Q", "u16": "Q", "u32": "Q", "u64": "Q"}
_SUCCESS, _INVALID_VALUE, _INVALID_CONTEXT = 0, 1, 201
_U64 = 1 << 64


class LaunchFailed(RuntimeError):
    """cuLaunchKernel refused the launch (nothing was enqueued).  ``context``: the calling
    thread had no current CUDA context (Triton's launcher makes one current: the next
    direct launch on that thread works)."""

    def __init__(self, message: str, context: bool = False):
        super().__init__(message)
        self.context = context


class Driver:
    """The two libcuda entry points a direct launch needs, typed."""

    def __init__(self, lib):
        self.launch = lib.cuLaunchKernel
        self.launch.restype = ctypes.c_int
        self.launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self.param_info = getattr(lib, "cuFuncGetParamInfo", None)  # (CUDA 12.4 and later)
        if self.param_info is not None:
            self.param_info.restype = ctypes.c_int
            self.param_info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                                        ctypes.POINTER(ctypes.c_size_t)]

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
def _driver() -> Driver | None:
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def layout(signature: list[str], sizes: list[int]) -> tuple[list[int], str, int] | None:
    """(indices of the arguments the kernel takes, the struct format of their 8-byte
    slots, how many NULL pointers follow them) for a Triton ``signature`` (each parameter's type, constexprs included, in order) against
    the driver's parameter ``sizes``; None where they do not agree or a type is not an
    integer one."""
    taken = [i for i, kind in enumerate(signature) if kind != "constexpr"]
    if any(signature[i] not in _SIZES for i in taken):
        return None
    extra = len(sizes) - len(taken)
    if extra < 0 or any(s != 8 for s in sizes[len(taken):]):
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


def _check(err: int) -> None:
    if err != _SUCCESS:
        raise LaunchFailed(f"cuLaunchKernel failed: CUresult {err}", context=err == _INVALID_CONTEXT)


class Block:
    """A parameter block of one kernel's launches: ``values`` (one 8-byte slot per
    parameter; an argument's slot is ``slot[i]``, i its index among the kernel's
    arguments) is what the next call launches with."""

    def __init__(self, launcher: DirectLaunch, args: tuple):
        n = launcher.nparams
        self.values = (ctypes.c_int64 * n)()
        self.slot = launcher.slot
        for i, p in launcher.slot.items():
            self.values[p] = _signed(args[i])
        self._pointers = (ctypes.c_void_p * n)(*(ctypes.addressof(self.values) + 8 * p for p in range(n)))
        self._launch, self._function = launcher.driver.launch, launcher.function
        self._threads, self._shared = launcher.threads, launcher.shared
        self._params = ctypes.addressof(self._pointers)

    def __call__(self, grid: int, stream: int) -> None:
        err = self._launch(self._function, grid, 1, 1, self._threads, 1, 1, self._shared, stream, self._params, None)
        if err:
            _check(err)


def _signed(v: int) -> int:
    """``v`` as the int64 whose low bytes are its little-endian encoding."""
    if not -(1 << 63) <= v < _U64:
        raise LaunchFailed(f"an argument does not fit 64 bits: {v}")
    return v - _U64 if v >= 1 << 63 else v


class DirectLaunch:
    """``cuLaunchKernel`` of one compiled kernel.  Its own calls share one parameter block
    under a lock; ``block(args)`` makes one for a caller that serialises its launches."""

    def __init__(self, driver: Driver, function: int, threads: int, shared: int, taken: list[int], fmt: str,
                 extra: int):
        self.driver, self.function, self.threads, self.shared = driver, function, threads, shared
        self.nparams = len(taken) + extra
        self.slot = {i: p for p, i in enumerate(taken)}
        self._pick = operator.itemgetter(*taken) if len(taken) > 1 else (lambda args, i=taken[0]: (args[i],))
        self._struct = struct.Struct(fmt)
        self._nulls = (0,) * extra
        self._shared_block = Block(self, (0,) * (max(taken) + 1))
        self._lock = threading.Lock()

    @classmethod
    def of(cls, compiled, num_warps: int) -> DirectLaunch | None:
        driver = _driver()
        signature = _signature(compiled)
        metadata = getattr(compiled, "metadata", None)
        function = getattr(compiled, "function", None)
        if driver is None or signature is None or metadata is None or not isinstance(function, int) or not function:
            return None
        if not _plain(metadata) or getattr(metadata, "num_warps", num_warps) != num_warps:
            return None
        sizes = driver.param_sizes(function)
        fixed = None if sizes is None else layout(signature, sizes)
        if fixed is None:
            return None
        taken, fmt, extra = fixed
        return cls(driver, function, 32 * num_warps, int(getattr(metadata, "shared", 0)), taken, fmt, extra)

    def block(self, args: tuple) -> Block:
        return Block(self, args)

    def __call__(self, grid: int, stream: int, args: tuple) -> None:
        block = self._shared_block
        with self._lock:
            try:
                self._struct.pack_into(block.values, 0, *self._pick(args), *self._nulls)
            except struct.error as exc:
                raise LaunchFailed(f"an argument does not fit its parameter: {exc}") from None
            block(grid, stream)
