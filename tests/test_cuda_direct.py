"""chorus.cuda.direct (a compiled kernel's launch straight through cuLaunchKernel) and the
lane's repeated launch (chorus.cuda.launchers.Shot, chorus.cuda.lanes.Lanes.shot), on the
CPU: a driver stand-in reads back the parameter block each launch would hand the GPU."""

from __future__ import annotations

import ctypes
import functools
import inspect
import os
import threading
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (the other CUDA tests' mode)
torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="triton is not installed (pip install 'chorus[cuda]')")

from chorus.cuda import direct  # noqa: E402

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p)
_PARAM_INFO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                               ctypes.POINTER(ctypes.c_size_t))
_GET_CONTEXT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
_SET_CONTEXT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class FakeLibcuda:
    """libcuda's entry points as C function pointers (ctypes callbacks), so that the calls
    go through ctypes as the driver's would: a function's parameters have ``sizes``; each
    launch's values are read back through the pointer array it got, each parameter
    ``sizes[i]`` bytes, little-endian and signed.  Each thread has a current context
    (context 5 where the test made one current; none in a new thread: launches fail with
    CUDA_ERROR_INVALID_CONTEXT)."""

    def __init__(self, sizes: list[int], fail: int = 0, info: bool = True):
        self.sizes, self.fail, self.launches = sizes, fail, []
        self.contexts = threading.local()
        self.contexts.current = 5

        def launch(func, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            if not getattr(self.contexts, "current", None):
                return 201
            if self.fail:
                return self.fail
            pointers = (ctypes.c_void_p * len(self.sizes)).from_address(params)
            values = [int.from_bytes(ctypes.string_at(p, size), "little", signed=True)
                      for p, size in zip(pointers, self.sizes, strict=True)]
            self.launches.append((func, (gx, gy, gz), (bx, by, bz), shared, stream, values, extra))
            return 0

        def param_info(func, index, offset, size):
            if index >= len(self.sizes):
                return 1  # CUDA_ERROR_INVALID_VALUE
            offset[0], size[0] = 8 * index, self.sizes[index]
            return 0

        def get_context(out):
            out[0] = getattr(self.contexts, "current", None)
            return 0

        def set_context(ctx):
            self.contexts.current = ctx
            return 0

        self.cuLaunchKernel = _LAUNCH(launch)
        self.cuCtxGetCurrent, self.cuCtxSetCurrent = _GET_CONTEXT(get_context), _SET_CONTEXT(set_context)
        if info:
            self.cuFuncGetParamInfo = _PARAM_INFO(param_info)

    def __getitem__(self, name: str):
        """Entry point ``name`` untyped (no argtypes), as ``CDLL.__getitem__`` gives it: the
        arguments reach the C function as the caller's ctypes objects make them."""
        return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(getattr(self, name), ctypes.c_void_p).value)


def _compiled(signature: dict, **metadata):
    meta = dict(num_warps=4, shared=96, num_ctas=1, cluster_dims=(1, 1, 1), launch_cooperative_grid=False,
                launch_pdl=False, global_scratch_size=0, profile_scratch_size=0)
    meta.update(metadata)
    return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=SimpleNamespace(**meta), function=FUNCTION)


FUNCTION = (1 << 40) | 77  # a CUfunction and a stream are 64-bit pointers: a launch that truncated
STREAM = (1 << 36) | 555  # either to 32 bits would show
SIG = {"inp": "i64", "out": "i64", "n": "i32", "rank": "constexpr", "flag": "u8", "op_id": "i32", "W": "constexpr"}


def _use(monkeypatch, lib: FakeLibcuda) -> FakeLibcuda:
    monkeypatch.setattr(direct, "_driver", lambda: direct.Driver(lib))
    return lib


class TypedOnly(FakeLibcuda):
    """A library object without ``CDLL``'s item access: the typed entry point is used."""

    __getitem__ = None


def test_a_library_without_item_access_launches_through_the_typed_entry_point(monkeypatch):
    lib = _use(monkeypatch, TypedOnly([8, 8, 4, 1, 4, 8, 8]))
    launch = direct.DirectLaunch.of(_compiled(SIG), 4)
    assert launch is not None and launch.driver.launch_ready is launch.driver.launch
    launch(12, STREAM, (1 << 40, 1 << 41, 1000, 3, 1, -7, 4))
    assert lib.launches == [(FUNCTION, (12, 1, 1), (128, 1, 1), 96, STREAM, [1 << 40, 1 << 41, 1000, 1, -7, 0, 0],
                             None)]


def test_a_launch_hands_the_driver_every_non_constexpr_argument_then_null_scratch(monkeypatch):
    lib = _use(monkeypatch, FakeLibcuda([8, 8, 4, 1, 4, 8, 8]))  # five arguments, two scratch pointers
    launch = direct.DirectLaunch.of(_compiled(SIG), 4)
    assert launch is not None
    launch(12, STREAM, (1 << 40, 1 << 41, 1000, 3, 1, -7, 4))
    launch(3, STREAM + 1, (16, 32, -(2**31), 3, 0, 2**31 - 1, 4))
    launch(0, 557, (16, 32, 1, 3, 0, 1, 4))  # (an empty grid: nothing, as Triton)
    assert lib.launches == [
        (FUNCTION, (12, 1, 1), (128, 1, 1), 96, STREAM, [1 << 40, 1 << 41, 1000, 1, -7, 0, 0], None),
        (FUNCTION, (3, 1, 1), (128, 1, 1), 96, STREAM + 1, [16, 32, -(2**31), 0, 2**31 - 1, 0, 0], None)]


def test_a_block_of_its_own_launches_with_the_values_written_into_its_slots(monkeypatch):
    lib = _use(monkeypatch, FakeLibcuda([8, 8, 4, 1, 4, 8, 8]))
    launch = direct.DirectLaunch.of(_compiled(SIG), 4)
    block = launch.block((1 << 40, 1 << 41, 1000, 3, 1, -7, 4))
    launch(1, 9, (5, 6, 7, 3, 0, 8, 4))  # (the launcher's own block: block's values stay)
    block(2, 10)
    block.values[block.slot[5]] = 12345
    block.values[block.slot[0]] = 1 << 44
    block(2, 11)
    assert [v for *_, v, _ in lib.launches] == [[5, 6, 7, 0, 8, 0, 0], [1 << 40, 1 << 41, 1000, 1, -7, 0, 0],
                                                [1 << 44, 1 << 41, 1000, 1, 12345, 0, 0]]
    assert block.slot == {0: 0, 1: 1, 2: 2, 4: 3, 5: 4}  # (constexprs 3 and 6 take no slot)


@pytest.mark.parametrize("sizes, metadata", [
    ([8, 8, 4, 1, 4, 8, 8], dict(global_scratch_size=64)),  # scratch Triton would allocate
    ([8, 8, 4, 1, 4, 8, 8], dict(num_ctas=2)),
    ([8, 8, 4, 1, 4, 8, 8], dict(cluster_dims=(2, 1, 1))),
    ([8, 8, 4, 1, 4, 8, 8], dict(launch_cooperative_grid=True)),
    ([8, 8, 4, 1, 4, 8, 8], dict(launch_pdl=True)),
    ([8, 8, 4, 1, 4, 8, 8], dict(num_warps=8)),  # not the warps asked for
    ([8, 8, 8, 1, 4, 8, 8], {}),  # a size that disagrees with the signature
    ([8, 8, 4, 1, 4], {}),  # no scratch pointers where the metadata has two kinds of scratch
    ([8, 8, 4, 1, 4, 8, 8, 8], {}),  # one parameter more than the arguments and the scratch
    ([8, 8, 4, 1, 4, 8, 4], {}),  # a trailing parameter that is no pointer
])
def test_a_kernel_the_layout_cannot_be_checked_against_stays_with_triton(monkeypatch, sizes, metadata):
    _use(monkeypatch, FakeLibcuda(sizes))
    assert direct.DirectLaunch.of(_compiled(SIG, **metadata), 4) is None


def test_other_parameter_types_a_driver_without_param_info_or_no_libcuda_stay_with_triton(monkeypatch):
    _use(monkeypatch, FakeLibcuda([8, 4, 8, 8]))
    assert direct.DirectLaunch.of(_compiled({"x": "*fp32", "n": "i32"}), 4) is None
    assert direct.DirectLaunch.of(_compiled({"x": "fp32", "n": "i32"}), 4) is None
    assert direct.DirectLaunch.of(_compiled({"x": "u1", "n": "i32"}), 4) is None  # (a bool argument)
    assert direct.DirectLaunch.of(_compiled({"x": "i64", "n": "i32"}), 4) is not None
    _use(monkeypatch, FakeLibcuda([8, 4, 8, 8], info=False))  # (a driver before CUDA 12.4)
    assert direct.DirectLaunch.of(_compiled({"x": "i64", "n": "i32"}), 4) is None
    monkeypatch.setattr(direct, "_driver", lambda: None)
    assert direct.DirectLaunch.of(_compiled({"x": "i64", "n": "i32"}), 4) is None
    monkeypatch.setattr(direct, "_driver", lambda: 1 / 0)  # (anything unforeseen: Triton's launcher)
    assert direct.DirectLaunch.of(_compiled({"x": "i64", "n": "i32"}), 4) is None


def test_values_out_of_their_parameters_range_or_invalid_parameters_raise_launch_failed(monkeypatch):
    lib = _use(monkeypatch, FakeLibcuda([8, 4, 2, 1, 8, 8]))
    launch = direct.DirectLaunch.of(_compiled({"x": "i64", "n": "i32", "h": "i16", "b": "u8"}), 4)
    for args in ((1 << 64, 6, 0, 0), (5, 1 << 31, 0, 0), (5, -(1 << 31) - 1, 0, 0), (5, 6, 1 << 15, 0),
                 (5, 6, 0, 256), (5, 6, 0, -1)):
        with pytest.raises(direct.LaunchFailed, match="does not fit"):
            launch(1, 1, args)
        with pytest.raises(direct.LaunchFailed, match="does not fit"):
            launch.block(args)
    assert lib.launches == []  # (nothing reached the driver truncated)
    lib.fail = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(direct.LaunchFailed, match="invalid"):
        launch(1, 1, (5, 6, 7, 8))
    lib.fail = 719  # CUDA_ERROR_LAUNCH_FAILED: an earlier kernel's fault, which Triton would meet too
    with pytest.raises(direct.DriverError, match="CUresult 719"):
        launch(1, 1, (5, 6, 7, 8))
    assert lib.launches == []


def test_a_thread_with_no_current_context_launches_in_the_kernel_s_context(monkeypatch):
    lib = _use(monkeypatch, FakeLibcuda([8, 4, 8, 8]))
    launch = direct.DirectLaunch.of(_compiled({"x": "i64", "n": "i32"}), 4)
    assert launch.context == 5
    seen = []

    def other_thread():
        launch(1, 3, (7, 8))
        seen.append(lib.contexts.current)

    th = threading.Thread(target=other_thread)
    th.start()
    th.join()
    assert seen == [5] and [v for *_, v, _ in lib.launches] == [[7, 8, 0, 0]]


def test_threads_launching_one_kernel_each_see_their_own_arguments(monkeypatch):
    lib = _use(monkeypatch, FakeLibcuda([8, 4, 8, 8]))
    launch = direct.DirectLaunch.of(_compiled({"x": "i64", "n": "i32"}), 4)

    def body(k):
        lib.contexts.current = 5
        for i in range(300):
            launch(1, k + 1, ((k + 1) * 1000 + i, k + 1))  # (stream 0 would reach the callback as None)

    threads = [threading.Thread(target=body, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(lib.launches) == 1200
    assert all(values[1] == stream and values[0] // 1000 == stream for _, _, _, _, stream, values, _ in lib.launches)
    assert all(values[2:] == [0, 0] for *_, values, _ in lib.launches)


# -- the lane's repeated launch ----------------------------------------------------------------
def _lanes(monkeypatch):
    """Two ranks' Lanes over host memory, rank 0's, on the real launchers with the cached
    launch path on (the interpreter runs without it) and its cache empty."""
    from chorus.cuda import launchers

    monkeypatch.setattr(launchers, "FAST", True)
    monkeypatch.setattr(launchers, "_COMPILED", {})
    from cuda_emulation import FakeWorkspace, memmove

    from chorus.cuda import layout as L
    from chorus.cuda.lanes import Lanes

    lay = L.Layout.of(2, 1 << 20)
    host = np.zeros(L.CONTROL_WORDS, np.int64)
    memories = [np.zeros(lay.total, np.uint8) for _ in range(2)]
    from chorus.cuda import launchers

    return Lanes(FakeWorkspace(0, memories, host, lay), 10.0, kernels=launchers, memcpy=memmove), memories


@pytest.mark.parametrize("algorithm, count", [("one_shot", 1024), ("two_shot_push", 1 << 14)])
def test_a_shot_launches_exactly_what_the_algorithm_would_for_the_same_op(monkeypatch, algorithm, count):
    """The same three ops through the algorithm each time, and through the first op's
    Shot after it: the same kernels with the same arguments (slots by round, epochs by
    barrier) on the same streams."""
    from chorus.cuda import algorithms as A
    from chorus.cuda import launchers

    def run(use_shots: bool) -> list:
        seen: list = []

        def record(kernel, key, grid, args, warps, stream=None):
            launchers._COMPILED.setdefault(key, (None, 0, 0, None))
            named = {data: "data", lanes.controls_addr: "controls", lanes.host: "host"}  # (each run's own)
            seen.append((kernel, grid, [named.get(a, a) if type(a) is int else a for a in args], warps, stream))

        monkeypatch.setattr(launchers, "launch", record)
        lanes, memories = _lanes(monkeypatch)
        data = memories[0].ctypes.data + 4096  # (16-byte aligned)
        shot = None
        for op_id in (5, 6, 7):
            lanes.begin(op_id, None, 100 + op_id, "bfloat16", "SUM", 1234)
            if shot is not None and use_shots:
                assert lanes.shot(shot, data)
            else:
                shot = A.all_reduce(lanes, data, count, 2, algorithm) or shot
        assert shot is not None and shot.kind == algorithm
        return seen + [("epoch", lanes.epoch, "rounds", lanes.rounds)]

    shots, algorithm_only = run(True), run(False)
    assert shots == algorithm_only
    slots = [launched[2][3] for launched in shots[:3]]
    assert slots[0] == slots[2] != slots[1]  # (the slot of each round's parity)


def test_a_shot_steps_aside_for_an_unaligned_address_64_bit_ids_or_a_capture(monkeypatch):
    from chorus.cuda import algorithms as A
    from chorus.cuda import launchers

    monkeypatch.setattr(launchers, "launch",
                        lambda kernel, key, *a, **k: launchers._COMPILED.setdefault(key, (None, 0, 0, None)))
    lanes, memories = _lanes(monkeypatch)
    data = memories[0].ctypes.data + 4096
    lanes.begin(1, None, 7, "float32", "SUM", 99)
    shot = A.all_reduce(lanes, data, 256, 4, "one_shot")
    epoch, rounds = lanes.epoch, lanes.rounds
    assert not lanes.shot(shot, data + 4)
    lanes.begin(1 << 40, None, 7, "float32", "SUM", 99)
    assert not lanes.shot(shot, data)
    lanes.begin(2, None, 7, "float32", "SUM", 99)
    lanes.graph = True
    assert not lanes.shot(shot, data)
    lanes.graph = False
    assert (lanes.epoch, lanes.rounds) == (epoch, rounds)  # nothing enqueued, nothing counted
    assert lanes.shot(shot, data)
    assert (lanes.epoch, lanes.rounds) == (epoch + 1, rounds + 1)


def test_no_shot_before_the_launch_was_compiled_and_cached(monkeypatch):
    from chorus.cuda import algorithms as A
    from chorus.cuda import launchers

    lanes, memories = _lanes(monkeypatch)
    monkeypatch.setattr(launchers, "launch", lambda *a, **k: None)  # (nothing cached: Triton's JIT each time)
    lanes.begin(1, None, 7, "float32", "SUM", 99)
    assert A.all_reduce(lanes, memories[0].ctypes.data, 256, 4, "one_shot") is None


@pytest.mark.parametrize("algorithm, count", [("one_shot", 1024), ("two_shot_push", 1 << 14)])
def test_a_shot_on_the_driver_writes_each_call_s_values_into_its_block(monkeypatch, algorithm, count):
    """With the kernels on the (faked) driver: the Shot's own parameter block holds, at
    every call, the values the algorithm's launch of the same op passes."""
    from chorus.cuda import algorithms as A
    from chorus.cuda import launchers

    def run(use_shots: bool) -> list:
        lib = _use(monkeypatch, FakeLibcuda([]))

        def record(kernel, key, grid, args, warps, stream=None):
            params = inspect.signature(kernel.fn).parameters.values()  # (jitted or interpreted)
            signature = {p.name: "constexpr" if "constexpr" in str(p.annotation) else "i64" for p in params}
            lib.sizes = [8] * (sum(kind == "i64" for kind in signature.values()) + 2)  # (and the scratch)
            entry = launchers._COMPILED.setdefault(key, (None, 0, 0, direct.DirectLaunch.of(
                _compiled(signature, num_warps=warps), warps)))
            entry[3](grid, stream, args)

        monkeypatch.setattr(launchers, "launch", record)
        lanes, memories = _lanes(monkeypatch)
        data = memories[0].ctypes.data + 4096
        shot = None
        for op_id in (5, 6, 7):
            lanes.begin(op_id, None, 100 + op_id, "bfloat16", "SUM", 1234)
            if shot is not None and use_shots:
                assert shot.block is not None and lanes.shot(shot, data)
            else:
                shot = A.all_reduce(lanes, data, count, 2, algorithm) or shot
        named = {data: "data", lanes.controls_addr: "controls", lanes.host: "host"}
        return [(grid, stream, [named.get(v, v) for v in values]) for _, (grid, _, _), _, _, stream, values, _
                in lib.launches]

    on_shots, on_the_algorithm = run(True), run(False)
    assert len(on_shots) == 3 and on_shots == on_the_algorithm
    assert on_shots[0][2][:2] == ["data", "data"] and on_shots[1][2][3] != on_shots[0][2][3]


def test_launch_goes_to_triton_s_jit_when_the_direct_launch_cannot_and_raises_device_errors(monkeypatch):
    """LaunchFailed (a value out of range, parameters the driver refused): nothing was
    enqueued, so Triton's JIT launches (and specialises) the kernel, from then on for that
    key; a device error is raised as it is (Triton's launcher would meet it too)."""
    from chorus.cuda import launchers

    monkeypatch.setattr(launchers, "FAST", True)
    monkeypatch.setattr(launchers, "_COMPILED", {})
    monkeypatch.setattr(launchers, "_raw_stream", lambda: 0)  # (torch's current stream)
    jitted: list = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, num_warps: jitted.append((grid, args, num_warps))

    def failing(exc):
        def launch(grid, stream, args):
            raise exc
        return launch

    launchers._COMPILED["k"] = (None, 1, 2, failing(direct.LaunchFailed("does not fit")))
    launchers.launch(Kernel(), "k", 3, (1, 2), 4, stream=0)
    assert jitted == [((3,), (1, 2), 4)] and launchers._COMPILED["k"] is False
    entry = launchers._COMPILED["d"] = (None, 1, 2, failing(direct.DriverError("CUresult 719")))
    with pytest.raises(direct.DriverError, match="719"):
        launchers.launch(Kernel(), "d", 3, (1, 2), 4, stream=0)
    assert launchers._COMPILED["d"] is entry and len(jitted) == 1


def test_no_shot_from_a_kernel_compiled_for_64_bit_ids(monkeypatch):
    """The Shot's key is the 32-bit one: a first launch with a 64-bit op id compiles
    another kernel, which no Shot repeats."""
    from chorus.cuda import algorithms as A
    from chorus.cuda import launchers

    monkeypatch.setattr(launchers, "launch",
                        lambda kernel, key, *a, **k: launchers._COMPILED.setdefault(key, (None, 0, 0, None)))
    lanes, memories = _lanes(monkeypatch)
    lanes.begin(1 << 40, None, 7, "float32", "SUM", 99)
    assert A.all_reduce(lanes, memories[0].ctypes.data + 4096, 256, 4, "one_shot") is None
    lanes.begin(2, None, 7, "float32", "SUM", 99)
    assert A.all_reduce(lanes, memories[0].ctypes.data + 4096, 256, 4, "one_shot") is not None


def test_triton_s_first_launch_hash_is_computed_on_a_thread_and_waited_for(monkeypatch):
    """launchers.warm_keys: Triton's hash of its own files (what its first launch in a
    process computes) runs on a thread of its own while the workspace is set up; the
    returned wait, and the first launch, end their wait once it is done; a failure there
    is left to the launch; nothing runs under the interpreter."""
    from chorus.cuda import launchers

    ran, release = [], threading.Event()

    def triton_key():
        release.wait(10)
        ran.append(threading.current_thread().name)
        return "key"

    monkeypatch.setattr(launchers.triton.runtime.cache, "triton_key", triton_key)
    monkeypatch.setattr(launchers, "INTERPRET", False)
    wait = launchers.warm_keys()
    assert ran == []  # (not on the caller's thread: it would have blocked above)
    release.set()
    wait()
    assert ran == ["chorus-triton-key"] and launchers._KEY_THREAD == []

    # the first launch through Triton waits for it (the workspace's set-up does not)
    release.clear()
    ran.clear()
    launchers.warm_keys()
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(list(ran))

    monkeypatch.setattr(launchers, "post_kernel", Kernel())
    release.set()
    launchers.post(1, 2, 3)
    assert seen == [["chorus-triton-key"]] and launchers._KEY_THREAD == []

    def broken():
        raise OSError("no such file")

    # computed already (Triton caches it): no thread
    computed = functools.lru_cache(triton_key)
    computed()
    ran.clear()
    monkeypatch.setattr(launchers.triton.runtime.cache, "triton_key", computed)
    launchers.warm_keys()()
    assert ran == [] and launchers._KEY_THREAD == []

    monkeypatch.setattr(launchers.triton.runtime.cache, "triton_key", broken)
    launchers.warm_keys()()  # (said at debug level; the launch computes it again)
    monkeypatch.setattr(launchers, "INTERPRET", True)
    ran.clear()
    monkeypatch.setattr(launchers.triton.runtime.cache, "triton_key", triton_key)
    launchers.warm_keys()()
    assert ran == []
