"""chorus.cuda.replays: a lane's repeated all_reduce replayed as a one-kernel CUDA graph,
on the CPU: the kernels on a faked driver (test_cuda_direct's), the graphs on a faked
capture that keeps the launches enqueued inside it."""

from __future__ import annotations

import ctypes
import inspect
import logging

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton", reason="triton is not installed (pip install 'chorus[cuda]')")

from test_cuda_direct import FakeLibcuda, _compiled, _lanes, _use  # noqa: E402

from chorus.cuda import direct, replays  # noqa: E402
from chorus.cuda import layout as L  # noqa: E402
from chorus.cuda.failures import OpNames  # noqa: E402

CAPTURE_STREAM = 4242


class FakeGraphs:
    """Stream capture and graph launch: a capture keeps the kernel launches ``enqueue``
    made (taken off the driver's list: nothing ran); a graph launch is recorded."""

    def __init__(self, lib: FakeLibcuda, refuse: bool = False):
        self.lib, self.refuse = lib, refuse
        self.graphs: dict[int, list] = {}
        self.launched: list[tuple[int, int]] = []

    def new_stream(self) -> int:
        return CAPTURE_STREAM

    def capture(self, stream: int, enqueue) -> int:
        if self.refuse:
            raise RuntimeError("cuStreamBeginCapture failed: CUresult 900")
        before = len(self.lib.launches)
        enqueue()
        nodes = self.lib.launches[before:]
        del self.lib.launches[before:]
        exe = 1000 + len(self.graphs)
        self.graphs[exe] = nodes
        return exe

    def launch(self, exe: int, stream) -> int:
        self.launched.append((exe, stream.value))
        return 0

    def destroy(self, exe: int) -> None:
        del self.graphs[exe]

    def destroy_stream(self, stream: int) -> None:
        assert stream == CAPTURE_STREAM
        self.graphs["stream destroyed"] = []


def _replaying(monkeypatch, refuse: bool = False):
    """Rank 0's Lanes (test_cuda_direct._lanes) with replays on, every launch on the faked
    driver: (lanes, data address, the driver, the graphs)."""
    from chorus.cuda import launchers

    lib = _use(monkeypatch, FakeLibcuda([]))

    def record(kernel, key, grid, args, warps, stream=None):
        params = inspect.signature(kernel.fn).parameters.values()
        signature = {p.name: "constexpr" if "constexpr" in str(p.annotation) else "i64" for p in params}
        lib.sizes = [8] * (sum(kind == "i64" for kind in signature.values()) + 2)
        entry = launchers._COMPILED.setdefault(key, (None, 0, 0, direct.DirectLaunch.of(
            _compiled(signature, num_warps=warps), warps)))
        entry[3](grid, stream, args)

    monkeypatch.setattr(launchers, "launch", record)
    graphs = FakeGraphs(lib, refuse)
    monkeypatch.setattr(replays, "driver", lambda: graphs)
    lanes, memories = _lanes(monkeypatch)
    lanes.replay, lanes.names = True, OpNames("g")
    return lanes, memories[0].ctypes.data + 4096, lib, graphs


def _params(shot, launched) -> dict:
    """What a launch of ``shot``'s kernel had: input, output, slot, op id and epoch (the
    fused kernels' arguments: inp, out, controls, slot_off, *head, op_id, fprint, epoch,
    graph_slot, ...)."""
    _, _, _, _, stream, values, _ = launched
    inp, out, slot, op_id, epoch = shot.where
    return dict(stream=stream, inp=values[inp], out=values[out], slot=values[slot], op_id=values[op_id],
                epoch=values[epoch])


@pytest.mark.parametrize("algorithm, count", [("one_shot", 1024), ("two_shot_push", 1 << 14)])
def test_a_repeated_all_reduce_becomes_graph_launches_that_count_as_the_kernels_would(monkeypatch, algorithm,
                                                                                     count):
    """Op 1 through the algorithm; the next ops of each slot parity: the replay kernel
    (epoch and op id from the device), then a graph captured on the lanes' own stream
    and launched on the op's, then that graph again.  Epochs and rounds advance as the
    kernel launches would advance them, and each replayed op's reported id names it."""
    from chorus.cuda import algorithms as A

    lanes, data, lib, graphs = _replaying(monkeypatch)
    names = lanes.names
    lanes.begin(names.add(None, 1, 1234, "all_reduce"), None, 101, "bfloat16", "SUM", 1234)
    shot = lanes.shots[("a plan",)] = A.all_reduce(lanes, data, count, 2, algorithm)  # (kept, as the component)
    epochs = [lanes.epoch]
    for seq in range(2, 9):
        lanes.begin(names.add(None, seq, 1234, "all_reduce"), None, 100 + seq, "bfloat16", "SUM", 1234)
        assert lanes.shot(shot, data)
        epochs.append(lanes.epoch)
    used = shot.barriers
    assert epochs == [epochs[0] + used * k for k in range(8)] and lanes.rounds == 8
    kernels = [_params(shot, launched) for launched in lib.launches]
    slots = [lanes.layout.slot_at(p) for p in (0, 1)]
    # ops 2 and 3: the replay kernel, once per parity, on the op's stream
    assert [(k["stream"], k["slot"], k["op_id"], k["epoch"]) for k in kernels[1:]] == [
        (102, slots[0], L.REPLAY_OP, 0), (103, slots[1], L.REPLAY_OP, 0)]
    # ops 4 and 5 captured (the same launch, on the capture stream), 4..8 launched as graphs
    assert [[(_params(shot, n)["stream"], _params(shot, n)["slot"], _params(shot, n)["op_id"])
             for n in nodes] for nodes in graphs.graphs.values()] == [
        [(CAPTURE_STREAM, slots[0], L.REPLAY_OP)], [(CAPTURE_STREAM, slots[1], L.REPLAY_OP)]]
    assert graphs.launched == [(1000, 104), (1001, 105), (1000, 106), (1001, 107), (1000, 108)]
    assert all((k["inp"], k["out"]) == (data, data) for k in kernels)
    for seq in range(2, 9):  # a replayed op's kernel reports REPLAY_OP + its first epoch
        assert names.entry(L.REPLAY_OP + epochs[seq - 2] + 1)[1] == seq
    assert names.entry(L.REPLAY_OP + epochs[-1] + 1) is None
    lanes.close()
    assert graphs.graphs == {"stream destroyed": []}


def test_the_steady_state_launches_the_kept_graph_as_shot_would_or_nothing(monkeypatch):
    """replay_kept (the lanes' steady state) launches the graph kept for the addresses and
    the next parity on the given stream, advancing rounds and epochs as shot() does and
    naming the op for its replayed kernel's reports; with a graph not kept yet, or work to
    follow first (a barrier beside a hand-off, NCCL's unjoined op), it enqueues nothing."""
    from chorus.cuda import algorithms as A

    lanes, data, lib, graphs = _replaying(monkeypatch)
    names, plan = lanes.names, ("a plan",)
    lanes.begin(names.add(None, 1, 77, "all_reduce"), None, 101, "bfloat16", "SUM", 77)
    shot = lanes.shots[plan] = A.all_reduce(lanes, data, 1024, 2, "one_shot")
    for seq in (2, 3):  # (each parity's first sight: the replay kernel, no graph yet)
        assert not lanes.replay_kept(plan, data, data, 100 + seq, seq, 77, "all_reduce")
        lanes.begin(names.add(None, seq, 77, "all_reduce"), None, 100 + seq, "bfloat16", "SUM", 77)
        assert lanes.shot(shot, data)
    assert not lanes.replay_kept(plan, data, data, 104, 4, 77, "all_reduce") and not graphs.launched
    for seq in (4, 5):  # (captured)
        lanes.begin(names.add(None, seq, 77, "all_reduce"), None, 100 + seq, "bfloat16", "SUM", 77)
        assert lanes.shot(shot, data)
    launched, before = list(graphs.launched), (lanes.rounds, lanes.epoch, len(lib.launches))
    epochs = []
    for seq in (6, 7, 8):
        epochs.append(lanes.epoch + 1)
        assert lanes.replay_kept(plan, data, data, 100 + seq, seq, 77, "all_reduce")
    assert graphs.launched == launched + [(1000, 106), (1001, 107), (1000, 108)]
    assert (lanes.rounds, lanes.epoch, len(lib.launches)) == (before[0] + 3, before[1] + 3 * shot.barriers, before[2])
    assert [names.entry(L.REPLAY_OP + e)[1:] for e in epochs] == [(6, 77), (7, 77), (8, 77)]
    for field in ("follow", "unjoined"):
        setattr(lanes, field, object())
        assert not lanes.replay_kept(plan, data, data, 109, 9, 77, "all_reduce")
        setattr(lanes, field, None)
    assert not lanes.replay_kept(plan, data + 256, data + 256, 109, 9, 77, "all_reduce")  # (other addresses)
    assert not lanes.replay_kept(("another plan",), data, data, 109, 9, 77, "all_reduce")
    assert len(graphs.launched) == len(launched) + 3 and lanes.rounds == before[0] + 3
    state = (lanes.rounds, lanes.epoch, names.last)
    graphs.launch = lambda exe, stream: 999  # the driver refuses: nothing counted, replays off for good
    assert not lanes.replay_kept(plan, data, data, 109, 9, 77, "all_reduce")
    assert (lanes.rounds, lanes.epoch, names.last) == state and not shot.replays.on and not shot.replays.kept
    lanes.begin(names.add(None, 9, 77, "all_reduce"), None, 109, "bfloat16", "SUM", 77)
    kernels = len(lib.launches)
    assert lanes.shot(shot, data) and len(lib.launches) == kernels + 1  # (the kernel, launched)
    lanes.close()


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_a_repeated_all_gather_or_reduce_scatter_replays_per_input_output_and_parity(monkeypatch, kind):
    """The lane's one-round all_gather / reduce_scatter (rows_once) leaves a Shot; its
    repeats launch it as the rows kernel's replay mode, then as graphs kept per (input,
    output, parity): another output address is another graph.  With replays off the
    Shot's launch has exactly rows_once's arguments (slot by round, epoch by barrier);
    the replay kernel and its graph have them too, but for the slot, op id and epoch."""
    lanes, data, lib, graphs = _replaying(monkeypatch)
    names, m, item = lanes.names, 300, 2
    out, other_out = data + (1 << 16), data + (1 << 17)
    lanes.begin(names.add(None, 1, 55, kind), None, 101, "bfloat16", "SUM" if kind == "reduce_scatter" else "", 55)
    shot = lanes.rows_once(kind, data, out, m, 320, item)
    assert shot is not None and shot.kind == kind and shot.barriers == 1
    eager = _params(shot, lib.launches[0])
    assert (eager["inp"], eager["out"], eager["op_id"], eager["epoch"]) == (data, out, names.last, lanes.epoch)
    epochs = [lanes.epoch]
    for seq, o in zip(range(2, 9), (out,) * 6 + (other_out,), strict=True):
        lanes.begin(names.add(None, seq, 55, kind), None, 100 + seq, "bfloat16", lanes.reduce_op, 55)
        assert lanes.shot(shot, data, o)
        epochs.append(lanes.epoch)
    assert epochs == [epochs[0] + k for k in range(8)] and lanes.rounds == 8
    kernels = [_params(shot, launched) for launched in lib.launches]
    slots = [lanes.layout.slot_at(p) for p in (0, 1)]
    # ops 2, 3 and 8 (a new output): the replay kernel; 4 and 5 captured; 4..7 graphs
    assert [(k["stream"], k["slot"], k["op_id"], k["epoch"], k["out"]) for k in kernels[1:]] == [
        (102, slots[0], L.REPLAY_OP, 0, out), (103, slots[1], L.REPLAY_OP, 0, out),
        (108, slots[0], L.REPLAY_OP, 0, other_out)]
    assert len(graphs.graphs) == 2 and graphs.launched == [(1000, 104), (1001, 105), (1000, 106), (1001, 107)]
    assert list(shot.replays.kept) == [(data, out, 0), (data, out, 1), (data, other_out, 0)]
    every = [list(launched[5]) for launched in lib.launches]  # (each launch's whole argument list)
    want, (_, _, slot_at, op_at, epoch_at) = list(every[0]), shot.where  # (rows_once's launch)
    assert want[op_at + 1] == 55  # the op's fingerprint
    want[slot_at], want[op_at], want[epoch_at] = slots[0], L.REPLAY_OP, 0
    assert every[1] == want and list(graphs.graphs[1000][0][5]) == want
    from chorus.cuda import launchers

    assert sorted(key[0][-1] for key in launchers._COMPILED if key[0][0] == kind) == [0, 2]  # (GRAPH: eager, replay)
    for seq in range(2, 9):
        assert names.entry(L.REPLAY_OP + epochs[seq - 2] + 1)[1] == seq

    shot.replays.close()
    lanes.replay, shot.replays = False, None  # the Shot's own launch, against rows_once's
    again, _ = _lanes(monkeypatch)
    seen = []
    for lane, use_shot in ((lanes, True), (again, False)):
        lane.replay, lane.names = False, names
        del lib.launches[:]
        for seq in (10, 11):
            lane.begin(seq, None, 7, "bfloat16", lanes.reduce_op, 55)
            fresh = lane.rows_once(kind, data, out, m, 320, item) if not use_shot else None
            assert fresh is not None or lane.shot(shot, data, out)
        launched = [(p["slot"], p["op_id"], p["epoch"] - lane.epoch) for p in (_params(shot, x) for x in lib.launches)]
        assert launched == [(slots[(lane.rounds - 1) & 1], 10, -1), (slots[lane.rounds & 1], 11, 0)], use_shot
        named = {lane.controls_addr: "controls", lane.host: "host"}
        seen.append([[named.get(v, v) if i != epoch_at else v - lane.epoch for i, v in enumerate(x[5])]
                     for x in lib.launches])
    assert seen[0] == seen[1]  # (every argument: the fingerprint, the geometry, the constants)


def test_a_shot_that_steps_aside_stays_kept_and_one_replaced_has_its_graphs_destroyed(monkeypatch):
    """An unaligned address steps the kept Shot aside; the algorithm's launch makes the
    same Shot again, and the kept one (with its graphs) stays.  A Shot replaced by
    another launch (as after the hints were turned off) has its graphs destroyed."""
    lanes, data, lib, graphs = _replaying(monkeypatch)
    out, plan = data + (1 << 16), ("a plan",)

    def gather(seq, inp):
        lanes.begin(lanes.names.add(None, seq, 55, "all_gather"), None, 100 + seq, "bfloat16", "", 55)
        lanes.repeat(plan, inp, out, lambda: lanes.rows_once("all_gather", inp, out, 300, 320, 2))

    for seq in range(1, 6):
        gather(seq, data)
    kept = lanes.shots[plan]
    assert sorted(graphs.graphs) == [1000, 1001]
    gather(6, data + 2)
    assert lanes.shots[plan] is kept and sorted(graphs.graphs) == [1000, 1001]
    other = kept.__class__(kept.kind, kept.n, kept.kernel, ("another key",), kept.grid, 1, kept.template, kept.where,
                           kept.warps, None)
    lanes.repeat(plan, data + 2, out, lambda: other)
    assert lanes.shots[plan] is other and graphs.graphs == {}
    lanes.close()
    assert graphs.graphs == {"stream destroyed": []}


def test_a_capture_the_driver_refuses_leaves_the_kernel_launch_for_good(monkeypatch, caplog):
    """A refused capture: that op and every later one launch the Shot's kernel (eager
    arguments), counted the same, and the warning says so once."""
    from chorus.cuda import algorithms as A

    lanes, data, lib, graphs = _replaying(monkeypatch, refuse=True)
    lanes.begin(1, None, 101, "float32", "SUM", 99)
    shot = A.all_reduce(lanes, data, 256, 4, "one_shot")
    first = lanes.epoch
    with caplog.at_level(logging.WARNING, logger="chorus"):
        for op_id in range(2, 7):
            lanes.begin(op_id, None, 100 + op_id, "float32", "SUM", 99)
            assert lanes.shot(shot, data)
    assert (lanes.epoch, lanes.rounds) == (first + 5, 6)
    kernels = [_params(shot, launched) for launched in lib.launches]
    assert [k["op_id"] for k in kernels] == [1, L.REPLAY_OP, L.REPLAY_OP, 4, 5, 6]  # (op 4's capture refused)
    assert [k["epoch"] for k in kernels[3:]] == [first + 3, first + 4, first + 5]
    assert graphs.launched == [] and shot.replays.on is False
    assert sum("replaying" in r.message for r in caplog.records) == 1


def test_an_unaligned_address_or_a_capture_never_replays(monkeypatch):
    from chorus.cuda import algorithms as A

    lanes, data, lib, graphs = _replaying(monkeypatch)
    lanes.begin(1, None, 101, "float32", "SUM", 99)
    shot = A.all_reduce(lanes, data, 256, 4, "one_shot")
    for op_id in (2, 3, 4):
        lanes.begin(op_id, None, 101, "float32", "SUM", 99)
        assert not lanes.shot(shot, data + 4)  # (the Shot steps aside too: the algorithm's path)
    lanes.graph = True
    assert not lanes.shot(shot, data)
    assert len(lib.launches) == 1 and graphs.graphs == {} and shot.replays.kept == {}


def test_a_full_shot_cache_or_more_addresses_than_kept_destroy_the_graphs_they_drop(monkeypatch):
    """Past KEPT (input, output, parity) triples the oldest one's graph is destroyed; a Shot
    cache that starts over destroys every graph of the Shots it drops; an address whose
    replay launch is no longer cached goes back to first sight (it is tried again)."""
    from chorus.cuda import algorithms as A
    from chorus.cuda import launchers

    monkeypatch.setattr(replays, "KEPT", 2)
    lanes, data, lib, graphs = _replaying(monkeypatch)
    lanes.begin(1, None, 101, "float32", "SUM", 99)
    shot = A.all_reduce(lanes, data, 256, 4, "one_shot")
    for op_id in range(2, 6):  # two sights of each parity: two graphs
        lanes.begin(op_id, None, 101, "float32", "SUM", 99)
        assert lanes.shot(shot, data)
    assert sorted(graphs.graphs) == [1000, 1001]
    other = data + 4096
    lanes.begin(6, None, 101, "float32", "SUM", 99)  # (parity of round 6: the oldest pair's evicted)
    assert lanes.shot(shot, other)
    assert list(shot.replays.kept) == [(data, data, 1), (other, other, lanes.rounds & 1)]
    assert sorted(graphs.graphs) == [1001]
    lanes.shots[("a plan",)] = shot
    lanes.forget_shots()
    assert lanes.shots == {} and shot.replays.kept == {} and graphs.graphs == {}
    monkeypatch.setattr(launchers, "replay_block", lambda *a: None)
    lanes.begin(7, None, 101, "float32", "SUM", 99)
    shot = A.all_reduce(lanes, data, 256, 4, "one_shot")
    for op_id in (8, 9, 10, 11):  # first sights, then no cached launch to capture: first sight again
        lanes.begin(op_id, None, 101, "float32", "SUM", 99)
        assert lanes.shot(shot, data)
        assert ((data, data, lanes.rounds & 1) in shot.replays.kept) == (op_id < 10), op_id
    assert graphs.graphs == {} and shot.replays.on


_CAPTURE = {"cuStreamBeginCapture_v2": (ctypes.c_void_p, ctypes.c_int),
            "cuStreamEndCapture": (ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)),
            "cuGraphInstantiateWithFlags": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_ulonglong),
            "cuGraphDestroy": (ctypes.c_void_p,), "cuGraphExecDestroy": (ctypes.c_void_p,),
            "cuStreamCreate": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint),
            "cuStreamDestroy_v2": (ctypes.c_void_p,), "cuGraphLaunch": (ctypes.c_void_p, ctypes.c_void_p)}


class CaptureLib:
    """libcuda's capture and graph entry points as C function pointers, logging calls."""

    def __init__(self):
        self.calls: list = []
        self._keep = {}
        for name, argtypes in _CAPTURE.items():
            fn = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(self._logged(name))
            self._keep[name] = fn
            setattr(self, name, fn)

    def _logged(self, name):
        def call(*args):
            self.calls.append(name)
            if name == "cuStreamEndCapture":
                args[1][0] = 77  # the captured graph
            if name == "cuGraphInstantiateWithFlags":
                args[0][0] = 88  # its executable
            return 0
        return call

    def __getitem__(self, name):
        return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(self._keep[name], ctypes.c_void_p).value)


def test_a_capture_always_ends_and_its_graph_is_destroyed_even_when_the_launch_raises():
    lib = CaptureLib()
    graphs = replays.GraphDriver(lib)
    exe = graphs.capture(5, lambda: lib.calls.append("launch"))
    assert exe.value == 88
    assert lib.calls == ["cuStreamBeginCapture_v2", "launch", "cuStreamEndCapture", "cuGraphInstantiateWithFlags",
                         "cuGraphDestroy"]
    lib.calls.clear()

    def refused():
        raise direct.LaunchFailed("an argument does not fit its parameter")

    with pytest.raises(direct.LaunchFailed):
        graphs.capture(5, refused)
    assert lib.calls == ["cuStreamBeginCapture_v2", "cuStreamEndCapture", "cuGraphDestroy"]
