"""The CUDA component's hand-offs to NCCL, run on the CPU with the GPU side faked
(streams, events, the workspace's lanes, the NCCL members): the barrier beside NCCL's op,
the order of ops after a hand-off (Lanes.follow, Lanes.unjoined), the Works an async
hand-off returns, and what a refused hand-off leaves.  Which calls hand off at all:
tests/test_cuda_nccl.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from chorus.cuda import beside, component  # noqa: E402
from chorus.cuda.component import CudaComponent  # noqa: E402


class _Stream:
    def __init__(self, raw: int = 123):
        self.cuda_stream = raw
        self.device = SimpleNamespace(index=0)

    def wait_stream(self, other) -> None:
        pass


def _handing_off(monkeypatch, log, barrier_finds=None):
    """A CudaComponent of a 1-rank group whose GPU side is faked (streams, events, the
    workspace's lanes and control page, the NCCL members), logging what it does, in
    order; ``barrier_finds``: control-page words a barrier writes (a failure it found)."""
    import numpy as np

    from chorus.cuda import layout as L

    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)  # (a CPU build lacks them)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: stream.cuda_stream, raising=False)
    monkeypatch.setattr(component.capture, "capturing", lambda: False)
    words = np.zeros(L.CONTROL_WORDS, np.int64)

    class Beside:  # chorus.cuda.beside's stream, logged
        def mark(self, raw: int) -> None:
            log.append(f"beside marks {raw}")

        def follow(self, raw: int | None = None) -> int:
            log.append(f"beside follows {raw}")
            return 7

        def end(self) -> str:
            log.append("barrier's end")
            return "barrier's end"

        joined = beside.Beside.joined  # (chorus's: join, then end)

        def synchronize(self) -> None:  # the barrier ran
            log.append("synchronize")
            for index, value in (barrier_finds or {}).items():
                words[index] = value

    peers = SimpleNamespace(run=lambda call: log.append(f"nccl {call.name}"),
                            watch=lambda w, i: log.append("watch"), agree=lambda call: log.append("agree"),
                            broken=None, abort_soon=lambda: log.append("abort"))
    lanes = SimpleNamespace(begin=lambda op, ctx, raw, *a, joins=True: log.append(
                                f"begin on {raw}{'' if joins else ', joining nothing'}"),
                            barrier=lambda: log.append("barrier"), follow=None, unjoined=None, shots={},
                            repeat=lambda plan, inp, out, first: first(),  # (no Shot kept: the algorithm each time)
                            replay_kept=lambda *a: False)

    def make_peers():
        log.append("make communicator")
        return peers

    def build(pg):
        comp = CudaComponent(pg, None)
        comp.ws = SimpleNamespace(words=words, device="cuda:0")
        comp.lanes, comp._nccl_guard, comp._device_index, comp._beside = lanes, True, 0, Beside()
        comp._torch = torch  # (a component with a workspace holds it)
        comp._make_peers = make_peers
        return comp

    return build


def _call(pg, name="all_reduce"):
    import numpy as np

    from chorus.call import make

    return make(pg, name, dtype="float32", count=4, buffers={"data": np.zeros(4, np.float32)}, async_op=False,
                algorithm="nccl", nbytes=16, args={"count": 4}, reduce_op="SUM" if name == "all_reduce" else "")


def _lane_ready(comp, monkeypatch) -> None:
    """``comp`` (from _handing_off) takes float32 CPU tensors of 16 bytes and more on its
    lane's hand-off, its communicator made by a first hand-off on the general path."""
    comp._reducible, comp._nccl_from, comp._device_index = frozenset({"float32"}), 16, -1  # (a CPU tensor)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 123, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    comp.start(_call(comp.pg), "nccl")
    comp._last_raw = 123


def _faked_lanes(monkeypatch):
    """A 1-rank Lanes over host memory, with the stream waits it asks for logged: (lanes,
    [(stream, event), ...])."""
    import numpy as np
    from cuda_emulation import FakeKernels, FakeWorkspace, memmove

    from chorus.cuda import layout as L
    from chorus.cuda import runtime
    from chorus.cuda.lanes import Lanes

    waits: list = []
    monkeypatch.setattr(runtime, "stream_wait_event", lambda stream, event: waits.append((stream, event)))
    lay = L.Layout.of(1, 1 << 20)
    host = np.zeros(L.CONTROL_WORDS, np.int64)
    lanes = Lanes(FakeWorkspace(0, [np.zeros(1 << 20, np.uint8)], host, lay), 10.0, kernels=FakeKernels(host),
                  memcpy=memmove)
    return lanes, waits


def test_the_first_hand_off_waits_for_its_barrier_before_making_the_communicator(monkeypatch):
    """Making the NCCL communicator waits for every rank; a rank whose op took chorus's
    kernels would never come, so the group's first hand-off waits on the CPU for the
    barrier that compares the ops.  Later hand-offs queue NCCL's op, then the barrier (on
    the stream beside the caller's, after the caller's work before NCCL's op), and nothing waits
    (inline when the group is idle); the group's next op follows the barrier."""
    from chorus.api.state import current
    from chorus.testing import run_threads

    log: list[str] = []
    build = _handing_off(monkeypatch, log)

    def body(rank, world):
        comp = build(current().default_group)
        comp.start(_call(comp.pg), "nccl")
        first = list(log)
        log.clear()
        comp.start(_call(comp.pg), "nccl")
        return first, list(log), comp.lanes.follow

    [(first, later, follow)] = run_threads(body, 1)
    barrier = ["begin on 7, joining nothing", "barrier", "barrier's end"]
    assert first == ["beside follows 123", *barrier, "synchronize", "make communicator", "watch",
                     "nccl all_reduce"], first
    # NCCL's op queued before the barrier's launch; the barrier after the work marked before it
    assert later == ["watch", "beside marks 123", "nccl all_reduce", "beside follows None", *barrier], later
    assert follow == "barrier's end"  # the group's next op waits for the barrier


def test_a_first_hand_off_whose_barrier_finds_another_op_raises_and_makes_no_communicator(monkeypatch):
    from chorus.api.state import current
    from chorus.cuda import layout as L
    from chorus.errors import CollectiveMismatchError
    from chorus.testing import run_threads
    from chorus.wire.fingerprint import fingerprint

    log: list[str] = []
    theirs = fingerprint("all_reduce", "float32", 1 << 20, -1, "SUM")
    build = _handing_off(monkeypatch, log, {L.FAIL_OP: 1, L.FAIL_PEERS: 0b1, L.FAIL_FP: theirs - (1 << 64) * (theirs >> 63),
                                            L.STATUS: L.MISMATCH})

    def body(rank, world):
        comp = build(current().default_group)
        with pytest.raises(CollectiveMismatchError) as err:
            comp.start(_call(comp.pg, "all_gather"), "nccl")
        return str(err.value)

    [text] = run_threads(body, 1)
    assert "make communicator" not in log and not any(e.startswith("nccl") for e in log), log
    assert "all_gather" in text and "all_reduce" in text, text


def test_the_op_after_a_hand_off_waits_for_its_barrier_once_and_never_in_a_capture(monkeypatch):
    """Lanes.follow (set by the barrier beside a hand-off) makes the next op's stream wait
    for that barrier, once; an op being captured leaves it to the next eager op."""
    lanes, waits = _faked_lanes(monkeypatch)
    lanes.begin(1, None, 11)
    assert waits == []
    lanes.follow = "barrier's end"
    lanes.graph = True
    lanes.begin(2, None, 12)
    assert waits == [] and lanes.follow == "barrier's end"
    lanes.graph = False
    lanes.begin(3, None, 13)
    lanes.begin(4, None, 14)
    assert waits == [(13, "barrier's end")] and lanes.follow is None


def test_the_op_after_an_async_hand_off_waits_for_nccls_op_once_and_the_barriers_beside_never(monkeypatch):
    """Lanes.unjoined (an async hand-off's NCCL op) is joined by the next op on chorus's
    kernels, once, before it waits for the event that join returns; the barrier beside a
    later hand-off (joins=False) and a captured op leave it for that op."""
    lanes, waits = _faked_lanes(monkeypatch)
    joins = []
    lanes.unjoined = lambda: joins.append("nccl's op") or "after nccl's op"
    lanes.follow = "barrier's end"
    lanes.begin(1, None, 7, joins=False)  # the barrier beside the next hand-off
    lanes.follow = "next barrier's end"
    lanes.graph = True
    lanes.begin(2, None, 12)
    lanes.graph = False
    assert joins == [] and waits == [(7, "barrier's end")]
    lanes.begin(3, None, 13)
    lanes.begin(4, None, 14)
    assert joins == ["nccl's op"] and waits == [(7, "barrier's end"), (13, "after nccl's op")]
    assert lanes.unjoined is None and lanes.follow is None


def test_a_join_that_raises_is_tried_again_by_the_next_op(monkeypatch):
    """A join that raised (a CUDA error) leaves NCCL's op to join: the next op on chorus's
    kernels still waits for it instead of only for the last barrier."""
    lanes, waits = _faked_lanes(monkeypatch)
    tries = []

    def join():
        tries.append(len(tries))
        if len(tries) == 1:
            raise RuntimeError("CUDA error")
        return "after nccl's op"

    lanes.follow, lanes.unjoined = "barrier's end", join
    with pytest.raises(RuntimeError):
        lanes.begin(3, None, 13)
    lanes.begin(4, None, 14)
    assert tries == [0, 1] and waits == [(14, "after nccl's op")] and lanes.unjoined is None


def test_an_async_hand_offs_event_is_after_its_own_nccl_op_not_the_later_barriers_beside(monkeypatch):
    """Beside.event_after records the Work's event on a stream of its own that waited for
    NCCL's op: the stream beside holds the later hand-offs' barriers, which a Work of an
    earlier op must not wait for (ProcessGroupNCCL's Work waits for its op only)."""
    import contextlib

    log: list[str] = []

    class Event:
        def record(self, stream):
            log.append(f"event recorded on {stream.name}")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: SimpleNamespace(name="its own stream"))
    current = []
    monkeypatch.setattr(torch.cuda, "stream",
                        lambda s: contextlib.nullcontext(current.append(s.name)))
    side = beside.Beside.__new__(beside.Beside)
    side.stream, side.waiter, side._lock = SimpleNamespace(name="beside", device=0), None, beside.threading.Lock()
    work = SimpleNamespace(get_future=lambda: SimpleNamespace(wait=lambda: log.append(f"{current[-1]} waits nccl's op")))
    side.event_after(work)
    side.event_after(work)
    assert log == ["its own stream waits nccl's op", "event recorded on its own stream"] * 2, log


def test_every_op_on_chorus_kernels_joins_an_async_hand_off_first(monkeypatch):
    """The kernel branch of all_reduce_now, the general path's enqueue and p2p each begin
    their op with joins (the default), so NCCL's op of an earlier async hand-off is
    waited for; only the barrier beside a hand-off begins without."""
    from chorus.api.state import current
    from chorus.reductions import ReduceOp
    from chorus.testing import run_threads

    log: list[str] = []
    build = _handing_off(monkeypatch, log)
    monkeypatch.setattr(component.A, "all_reduce", lambda lanes, *a: log.append("kernel all_reduce"))
    monkeypatch.setattr(component.A, "enqueue", lambda lanes, *a: log.append("kernel op"))
    monkeypatch.setattr(component.A, "exchange", lambda lanes, *a: log.append("kernel p2p"))

    def body(rank, world):
        comp = build(current().default_group)
        _lane_ready(comp, monkeypatch)
        comp._nccl_from = 1 << 40  # (every size on chorus's kernels)
        comp._plans.clear()
        monkeypatch.setattr(type(comp), "work_after", lambda self, *a: "work")
        monkeypatch.setattr(component.capture, "check", lambda *a: None)
        log.clear()
        t = torch.ones(8)
        assert comp.all_reduce_now(t, ReduceOp.SUM) is True
        comp._enqueue(_call(comp.pg), None, 1, SimpleNamespace(cuda_stream=123))
        comp.launch_on = lambda stream, enqueue: enqueue(stream)
        comp.p2p_batch([("send", t, 0, 0)], False)
        return list(log)

    [seen] = run_threads(body, 1)
    assert seen == ["begin on 123", "kernel all_reduce", "begin on 123", "kernel op", "begin on 123",
                    "kernel p2p"], seen


def test_the_lane_hands_a_repeated_large_all_reduce_to_nccl_then_queues_its_barrier(monkeypatch):
    """Once the group's communicator exists, an all_reduce of the hand-off size takes the
    API's lane (no Call): NCCL's op first, the barrier beside it after the caller's work
    marked before it, AVG divided after NCCL's sum; async returns a Work holding NCCL's
    own Work (its future is what torch callers get), and only the stream beside waits for
    NCCL's op.  The group's first hand-off and a
    call on another stream take the general path."""
    from chorus.api.state import current
    from chorus.reductions import ReduceOp
    from chorus.testing import run_threads

    log: list[str] = []
    build = _handing_off(monkeypatch, log)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    native = SimpleNamespace(wait=lambda: log.append("nccl's wait"))

    def body(rank, world):
        comp = build(current().default_group)
        comp._reducible, comp._nccl_from, comp._device_index = frozenset({"float32"}), 16, -1  # (a CPU tensor)
        monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: -1, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 123, raising=False)
        t = torch.ones(8)
        before = comp.all_reduce_now(t, ReduceOp.SUM)  # no communicator yet: the general path's
        comp.start(_call(comp.pg), "nccl")  # makes it (the group's first hand-off)
        comp._nccl.all_reduce = lambda tensor, op, wait: log.append(
            f"nccl {op} of {tensor.numel()}{'' if wait else ', not waited for'}") or native
        comp._last_raw = 123
        log.clear()
        leaf = torch.ones(8, requires_grad=True)  # (AVG divides a detached view, as the general path)
        done = comp.all_reduce_now(leaf, ReduceOp.AVG) and torch.equal(leaf.detach(), torch.ones(8))
        sync = list(log)
        log.clear()
        comp._beside.join = lambda work: log.append("beside joins nccl's op")
        comp._beside.event_after = lambda work: log.append("an event after nccl's op") or "event"
        comp._beside.stream = "beside's stream"
        work = comp.all_reduce_now(t, ReduceOp.SUM, async_op=True)
        nowait = list(log)
        log.clear()
        follow = comp.lanes.unjoined()  # what the group's next op on chorus's kernels does first
        joined = list(log)
        log.clear()
        work.wait()
        waited = list(log)
        log.clear()
        event = work._event  # (is_completed, synchronize and a chorus future need one)
        joined.append((waited, list(log), event, work._event))
        log.clear()
        comp._last_raw = 999  # the caller moved to another stream: the general path's
        other = comp.all_reduce_now(t, ReduceOp.SUM)
        return before, done, sync, work, other, t, nowait, joined, follow

    [(before, done, sync, work, other, t, nowait, joined, follow)] = run_threads(body, 1)
    assert before is False and done is True and other is False
    # (NcclPeers runs AVG as NCCL's SUM: NCCL_OPS; the lane divides after)
    assert sync == ["watch", "beside marks 123", "nccl AVG of 8", "beside follows None",
                    "begin on 7, joining nothing", "barrier", "barrier's end"], sync
    assert torch.equal(t, torch.ones(8))  # AVG over 1 rank: NCCL's sum (faked: unchanged) divided by 1
    assert work.result()[0] is t and work.native is native
    # async: neither the caller's stream nor the stream beside waits for NCCL's op now;
    # the group's next op on chorus's kernels makes the stream beside wait for it and
    # follows that (Lanes.unjoined, then Lanes.follow)
    assert nowait == ["watch", "beside marks 123", "nccl SUM of 8, not waited for", "beside follows None",
                      "begin on 7, joining nothing", "barrier", "barrier's end"], nowait
    *joined, (waited, made, event, again) = joined
    assert joined == ["beside joins nccl's op", "barrier's end"] and follow == "barrier's end", joined
    # the Work's wait is NCCL's; an event after NCCL's op is made once, when first asked for
    assert waited == ["nccl's wait"] and made == ["an event after nccl's op"] and event == again == "event"


def test_a_torch_work_hands_out_nccls_own_future_when_nccl_ran_the_op(monkeypatch):
    """TorchWork.get_future of one op NCCL ran whole returns NCCL's Work's future (no
    new future, no pickling of the value, no wait); any other stream op gets a new
    CUDA-aware one after its wait."""
    from chorus.torch.work import TorchWork
    from chorus.work import Work

    class Queued(Work):  # a CudaWork's face: queued on a stream, done as far as the CPU is concerned
        on_stream = True

        def __init__(self, native):
            super().__init__([])
            self.native = native

        def wait(self, timeout=None):
            waits.append(self)
            return True

        def check(self) -> None:
            pass

        def is_completed(self):
            return True

    waits: list = []
    sentinel = torch.futures.Future()
    native = SimpleNamespace(get_future=lambda: sentinel)
    monkeypatch.setattr(TorchWork, "_stream_devices", lambda self: [torch.device("cpu")])
    made = []
    monkeypatch.setattr(torch.futures, "Future", lambda devices=None: made.append(devices) or sentinel)
    # NCCL's future, and the caller's stream is not made to wait (it waits when the
    # future's consumer does)
    work = TorchWork([Queued(native)], [torch.ones(2)])
    assert work.get_future() is sentinel and made == [] and waits == []
    assert work.wait() and work.get_future() is sentinel and not sentinel.done()  # (waiting after: still NCCL's)
    waits.clear()
    TorchWork([Queued(None)], [torch.ones(2)]).get_future()
    assert made == [[torch.device("cpu")]] and len(waits) == 1


def test_a_hand_off_that_nccl_refuses_still_queues_its_barrier_and_raises(monkeypatch):
    """NCCL's op raising (an aborted communicator) must not leave this rank a barrier
    behind its peers: the barrier beside is queued anyway, the group's next op follows
    it, and the error reaches the caller."""
    from chorus.api.state import current
    from chorus.reductions import ReduceOp
    from chorus.testing import run_threads

    log: list[str] = []
    build = _handing_off(monkeypatch, log)

    def body(rank, world):
        comp = build(current().default_group)
        _lane_ready(comp, monkeypatch)

        def refused(tensor, op, wait):
            log.append("nccl refuses")
            raise RuntimeError("NCCL communicator was aborted")

        comp._nccl.all_reduce = refused
        log.clear()
        with pytest.raises(RuntimeError, match="aborted"):
            comp.all_reduce_now(torch.ones(8), ReduceOp.SUM, async_op=True)
        return list(log), comp.lanes.follow

    [(seen, follow)] = run_threads(body, 1)
    assert seen == ["watch", "beside marks 123", "nccl refuses", "beside follows None",
                    "begin on 7, joining nothing", "barrier", "barrier's end"], seen
    assert follow == "barrier's end"


def test_the_flight_recorder_holds_the_cuda_lanes_ops_sync_async_and_failed(monkeypatch):
    """A CUDA group's lane ops (kernels or hand-offs, sync or async) are in its flight
    recorder as the CPU lanes' are: seq, op, dtype, count, component, algorithm, async,
    and a failure with its error."""
    from chorus.api.state import current
    from chorus.cuda.plans import LaneLog
    from chorus.debug import flight
    from chorus.reductions import ReduceOp
    from chorus.testing import run_threads

    log: list[str] = []
    build = _handing_off(monkeypatch, log)

    def body(rank, world):
        comp = build(current().default_group)
        _lane_ready(comp, monkeypatch)  # (its first hand-off: the general path's own entry)
        comp._lane_log = LaneLog(flight.attach(comp.pg))
        comp._nccl.all_reduce = lambda tensor, op, wait: None
        monkeypatch.setattr(type(comp), "work_after", lambda self, s, what, result, keep, nat=None: "work")
        comp._beside.join = lambda work: None
        t = torch.ones(8)
        assert comp.all_reduce_now(t, ReduceOp.SUM) is True
        assert comp.all_reduce_now(t, ReduceOp.SUM, async_op=True) == "work"

        def refused(tensor, op, wait):
            raise RuntimeError("NCCL communicator was aborted")

        comp._nccl.all_reduce = refused
        with pytest.raises(RuntimeError):
            comp.all_reduce_now(t, ReduceOp.SUM, async_op=True)
        return [e for e in comp.pg.flight.entries() if e["lane"]]

    [lane] = run_threads(body, 1)
    assert [(e["op"], e["dtype"], e["count"], e["component"], e["algorithm"], e["async"], e["state"])
            for e in lane] == [("all_reduce", "float32", 8, "cuda", "nccl", False, flight.DONE),
                               ("all_reduce", "float32", 8, "cuda", "nccl", True, flight.DONE),
                               ("all_reduce", "float32", 8, "cuda", "nccl", True, flight.FAILED)], lane
    assert [e["seq"] for e in lane] == [1, 2, 3] and "aborted" in lane[2]["error"]
