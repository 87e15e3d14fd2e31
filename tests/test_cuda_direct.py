"""chorus.cuda.direct (a compiled kernel's launch straight through cuLaunchKernel) and the
lane's repeated launch (chorus.cuda.launchers.Shot, chorus.cuda.lanes.Lanes.shot), on the
CPU: a driver stand-in reads back the parameter block each launch would hand the GPU."""

from __future__ import annotations

import ctypes
import inspect
import threading
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from chorus.cuda import direct  # noqa: E402

_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p)
_PARAM_INFO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                               ctypes.POINTER(ctypes.c_size_t))


class FakeLibcuda:
    """libcuda's two entry points as C function pointers (ctypes callbacks), so that the
    calls go through ctypes as the driver's would: a function's parameters have
    ``sizes``; each launch's values are read back through the pointer array it got, each
    parameter ``sizes[i]`` bytes, little-endian and signed."""

    def __init__(self, sizes: list[int], fail: int = 0, info: bool = True):
        self.sizes, self.fail, self.launches = sizes, fail, []

        def launch(func, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
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

        self.cuLaunchKernel = _LAUNCH(launch)
        if info:
            self.cuFuncGetParamInfo = _PARAM_INFO(param_info)


def _compiled(signature: dict, **metadata):
    meta = dict(num_warps=4, shared=96, num_ctas=1, cluster_dims=(1, 1, 1), launch_cooperative_grid=False,
                launch_pdl=False, global_scratch_size=0, profile_scratch_size=0)
    meta.update(metadata)
    return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=SimpleNamespace(**meta), function=77)


SIG = {"inp": "i64", "out": "i64", "n": "i32", "rank": "constexpr", "flag": "i1", "op_id": "i32", "W": "constexpr"}


def _use(monkeypatch, lib: FakeLibcuda) -> FakeLibcuda:
    monkeypatch.setattr(direct, "_driver", lambda: direct.Driver(lib))
    return lib


def test_a_launch_hands_the_driver_every_non_constexpr_argument_then_null_scratch(monkeypatch):
    lib = _use(monkeypatch, FakeLibcuda([8, 8, 4, 1, 4, 8, 8]))  # five arguments, two scratch pointers
    launch = direct.DirectLaunch.of(_compiled(SIG), 4)
    assert launch is not None
    launch(12, 555, (1 << 40, 1 << 41, 1000, 3, True, -7, 4))
    launch(3, 556, (16, 32, 1, 3, False, 2**31 - 1, 4))
    assert lib.launches == [
        (77, (12, 1, 1), (128, 1, 1), 96, 555, [1 << 40, 1 << 41, 1000, 1, -7, 0, 0], None),
        (77, (3, 1, 1), (128, 1, 1), 96, 556, [16, 32, 1, 0, 2**31 - 1, 0, 0], None)]


def test_a_block_of_its_own_launches_with_the_values_written_into_its_slots(monkeypatch):
    lib = _use(monkeypatch, FakeLibcuda([8, 8, 4, 1, 4, 8, 8]))
    launch = direct.DirectLaunch.of(_compiled(SIG), 4)
    block = launch.block((1 << 40, 1 << 41, 1000, 3, True, -7, 4))
    launch(1, 9, (5, 6, 7, 3, False, 8, 4))  # (the launcher's own block: block's values stay)
    block(2, 10)
    block.values[block.slot[5]] = 12345
    block.values[block.slot[0]] = 1 << 44
    block(2, 11)
    assert [v for *_, v, _ in lib.launches] == [[5, 6, 7, 0, 8, 0, 0], [1 << 40, 1 << 41, 1000, 1, -7, 0, 0],
                                                [1 << 44, 1 << 41, 1000, 1, 12345, 0, 0]]
    assert block.slot == {0: 0, 1: 1, 2: 2, 4: 3, 5: 4}  # (constexprs 3 and 6 take no slot)


@pytest.mark.parametrize("sizes, metadata", [
    ([8, 8, 4, 1, 4], dict(global_scratch_size=64)),  # scratch Triton would allocate
    ([8, 8, 4, 1, 4], dict(num_ctas=2)),
    ([8, 8, 4, 1, 4], dict(cluster_dims=(2, 1, 1))),
    ([8, 8, 4, 1, 4], dict(launch_cooperative_grid=True)),
    ([8, 8, 4, 1, 4], dict(launch_pdl=True)),
    ([8, 8, 4, 1, 4], dict(num_warps=8)),  # not the warps asked for
    ([8, 8, 8, 1, 4], {}),  # a size that disagrees with the signature
    ([8, 8, 4, 1], {}),  # fewer parameters than arguments
    ([8, 8, 4, 1, 4, 4], {}),  # a trailing parameter that is no pointer
])
def test_a_kernel_the_layout_cannot_be_checked_against_stays_with_triton(monkeypatch, sizes, metadata):
    _use(monkeypatch, FakeLibcuda(sizes))
    assert direct.DirectLaunch.of(_compiled(SIG, **metadata), 4) is None


def test_other_parameter_types_a_driver_without_param_info_or_no_libcuda_stay_with_triton(monkeypatch):
    _use(monkeypatch, FakeLibcuda([8, 4]))
    assert direct.DirectLaunch.of(_compiled({"x": "*fp32", "n": "i32"}), 4) is None
    assert direct.DirectLaunch.of(_compiled({"x": "fp32", "n": "i32"}), 4) is None
    assert direct.DirectLaunch.of(_compiled({"x": "i64", "n": "i32"}), 4) is not None
    _use(monkeypatch, FakeLibcuda([8, 4], info=False))  # (a driver before CUDA 12.4)
    assert direct.DirectLaunch.of(_compiled({"x": "i64", "n": "i32"}), 4) is None
    monkeypatch.setattr(direct, "_driver", lambda: None)
    assert direct.DirectLaunch.of(_compiled({"x": "i64", "n": "i32"}), 4) is None


def test_a_refused_launch_or_an_argument_too_wide_raises_launch_failed_and_enqueues_nothing(monkeypatch):
    lib = _use(monkeypatch, FakeLibcuda([8, 4], fail=719))
    launch = direct.DirectLaunch.of(_compiled({"x": "i64", "n": "i32"}), 4)
    with pytest.raises(direct.LaunchFailed, match="cuLaunchKernel failed: CUresult 719") as raised:
        launch(1, 0, (5, 6))
    assert not raised.value.context
    lib.fail = 201  # CUDA_ERROR_INVALID_CONTEXT: this thread has no current context
    with pytest.raises(direct.LaunchFailed) as raised:
        launch(1, 0, (5, 6))
    assert raised.value.context
    lib.fail = 0
    with pytest.raises(direct.LaunchFailed, match="does not fit"):
        launch(1, 0, (1 << 64, 6))
    with pytest.raises(direct.LaunchFailed, match="does not fit"):
        launch.block((1 << 64, 6))
    assert lib.launches == []


def test_threads_launching_one_kernel_each_see_their_own_arguments(monkeypatch):
    lib = _use(monkeypatch, FakeLibcuda([8, 4]))
    launch = direct.DirectLaunch.of(_compiled({"x": "i64", "n": "i32"}), 4)

    def body(k):
        for i in range(300):
            launch(1, k + 1, ((k + 1) * 1000 + i, k + 1))  # (stream 0 would reach the callback as None)

    threads = [threading.Thread(target=body, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(lib.launches) == 1200
    assert all(values[1] == stream and values[0] // 1000 == stream for _, _, _, _, stream, values, _ in lib.launches)


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
            lib.sizes = [8] * sum(kind == "i64" for kind in signature.values())
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
