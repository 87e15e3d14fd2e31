"""The CUDA lane of all_gather_into_tensor and reduce_scatter_tensor
(``CudaComponent.rows_now``, chorus.cuda.plans.rows_plan), on the CPU: the GPU side faked
(test_cuda_handoff's component, test_cuda_direct's Lanes over host memory with the
launches recorded).  What a repeated call enqueues must be what the general path's Call
enqueues for the same op, under the same fingerprint, so ranks may take either path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="triton is not installed (pip install 'chorus[cuda]')")

from test_cuda_direct import _lanes  # noqa: E402
from test_cuda_handoff import _handing_off, _lane_ready  # noqa: E402

from chorus.cuda import algorithms as A  # noqa: E402
from chorus.cuda import launchers  # noqa: E402
from chorus.cuda.plans import rows_plan  # noqa: E402
from chorus.reductions import ReduceOp, make_premul_sum  # noqa: E402
from chorus.wire.fingerprint import fingerprint  # noqa: E402

WORLD = 2


def _general_fingerprint(monkeypatch, name, output, input, op):
    """The fingerprint of the Call the API's general path makes for the same op."""
    from chorus.api import exchange, gathering

    seen = {}

    def collective(pg, call_name, *, dtype, count, reduce_op="", **_):
        seen["fp"] = fingerprint(call_name, dtype, count, -1, reduce_op)

    monkeypatch.setattr(gathering, "collective", collective)
    monkeypatch.setattr(exchange, "collective", collective)
    group = SimpleNamespace(size=lambda: WORLD, rank=lambda: 0)
    monkeypatch.setattr(gathering, "member_group", lambda g, op: group)
    monkeypatch.setattr(exchange, "member_group", lambda g, op: group)
    if name == "all_gather":
        gathering.all_gather_into_tensor(output, input, algorithm="fused")
    else:
        exchange.reduce_scatter_tensor(output, input, op=op, algorithm="fused")
    return seen["fp"]


@pytest.mark.parametrize("name, dtype, op", [("all_gather", torch.bfloat16, None), ("all_gather", torch.int8, None),
                                             ("reduce_scatter", torch.float32, ReduceOp.SUM),
                                             ("reduce_scatter", torch.bfloat16, ReduceOp.AVG),
                                             ("reduce_scatter", torch.int32, ReduceOp.BXOR)])
def test_a_rows_plan_carries_the_general_path_s_fingerprint(monkeypatch, name, dtype, op):
    m = 300
    small, big = torch.zeros(m, dtype=dtype), torch.zeros(WORLD * m, dtype=dtype)
    out, inp = (big, small) if name == "all_gather" else (small, big)
    plan = rows_plan(name, out, inp, op, WORLD, launchers.REDUCIBLE, 0, 1 << 20)
    assert plan is not None and (plan.m, plan.item, plan.stride) == (m, small.element_size(), 320)
    assert plan.fingerprint == _general_fingerprint(monkeypatch, name, out, inp, op)
    assert plan.average == (op is ReduceOp.AVG)


def test_the_general_path_decides_errors_nccl_sizes_rounds_and_premul_sum():
    def plan(name, out, inp, op=ReduceOp.SUM, nccl_from=0, slot=1 << 20):
        return rows_plan(name, out, inp, op, WORLD, launchers.REDUCIBLE, nccl_from, slot)

    x, x2 = torch.zeros(256), torch.zeros(512)
    assert plan("all_gather", x2, x) is not None
    assert plan("all_gather", torch.zeros(511), x) is None  # (a size error: the API raises it)
    assert plan("all_gather", x2.double(), x) is None  # (dtypes differ)
    assert plan("all_gather", x2[:0], x[:0]) is None  # (empty)
    assert plan("all_gather", x2, x, nccl_from=2048) is None  # (W x 1 KiB: NCCL's, by the general path)
    assert plan("all_gather", x2, x, nccl_from=2049) is not None
    assert plan("all_gather", x2, x, slot=2 * 4 * 192) is None  # more than one round of the slot
    assert plan("reduce_scatter", x, x2, make_premul_sum(0.5)) is None
    assert plan("reduce_scatter", x.int(), x2.int(), ReduceOp.AVG) is None  # (the API raises)
    assert plan("reduce_scatter", x, x2, ReduceOp.BAND) is None
    assert plan("reduce_scatter", x.to(torch.complex64), x2.to(torch.complex64)) is None  # not reducible


def _in_group(monkeypatch, test):
    """``test(comp, seen)`` inside a 1-rank chorus group: ``comp`` the faked component of
    test_cuda_handoff on rank 0's real Lanes of a 2-rank group over host memory
    (test_cuda_direct), ``seen`` the launches it makes (kernel, grid, args, stream)."""
    from chorus.api.state import current
    from chorus.testing import run_threads

    seen: list = []
    build = _handing_off(monkeypatch, [])

    def body(rank, world):
        comp = build(current().default_group)
        _lane_ready(comp, monkeypatch)
        comp._plans.clear()
        lanes, _ = _lanes(monkeypatch)
        monkeypatch.setattr(launchers, "launch", lambda kernel, key, grid, args, warps, stream=None:
                            seen.append((kernel, grid, args, stream)))
        lanes.names = comp.names
        comp.lanes = lanes
        comp.pg.size = lambda: WORLD  # (the lanes are rank 0's of two)
        test(comp, seen)
        return True

    assert run_threads(body, 1) == [True]


@pytest.mark.parametrize("name", ["all_gather", "reduce_scatter"])
def test_the_lane_launches_what_the_general_path_s_algorithm_launches(monkeypatch, name):
    """rows_now on rank 0 of a 2-rank group enqueues the fused kernel's round exactly as
    chorus.cuda.algorithms' all_gather / reduce_scatter (fused) does for the same op,
    on the op's stream; AVG divides after; the epoch and rounds advance alike."""

    def test(comp, seen):
        lanes = comp.lanes
        m = 300
        small, big = torch.arange(m, dtype=torch.float32), torch.arange(WORLD * m, dtype=torch.float32)
        out, inp = (big.clone(), small) if name == "all_gather" else (small.clone().requires_grad_(), big)
        op = None if name == "all_gather" else ReduceOp.AVG  # (AVG into a leaf that requires grad, as the API)
        assert comp.rows_now(name, out, inp, op) is True
        by_lane, lane_count = list(seen), (lanes.epoch, lanes.rounds)
        seen.clear()
        other, _ = _lanes(monkeypatch)
        _, _, fprint = comp.names.entry(comp.names.last)
        other.begin(comp.names.last, None, 123, lanes.dtype, lanes.reduce_op, fprint)
        if name == "all_gather":
            A.all_gather(other, inp.data_ptr(), out.data_ptr(), m, 4, -1, True)
        else:
            A.reduce_scatter(other, inp.data_ptr(), out.data_ptr(), (m,) * WORLD, 4, True)
        as_named = [[(k, g, [n.get(a, a) if type(a) is int else a for a in args], s) for k, g, args, s in launched]
                    for n, launched in (({lanes.controls_addr: "controls", lanes.host: "host"}, by_lane),
                                        ({other.controls_addr: "controls", other.host: "host"}, seen))]
        assert len(as_named[0]) == 1 and as_named[0] == as_named[1]
        assert as_named[0][0][3] == 123  # (the op's stream: the group's last)
        assert lane_count == (other.epoch, other.rounds)
        if name == "reduce_scatter":
            assert torch.equal(out.detach(), small / WORLD)  # (the faked launch reduced nothing: AVG's division)
        assert (lanes.dtype, lanes.reduce_op) == ("float32", "" if op is None else "AVG")

    _in_group(monkeypatch, test)


def test_the_lane_steps_aside_for_a_non_contiguous_tensor_a_capture_a_broken_group_or_a_dtype_change(
        monkeypatch):
    def test(comp, seen):
        x, x2 = torch.zeros(256), torch.zeros(512)
        assert comp.rows_now("all_gather", torch.zeros(2, 256).t(), torch.zeros(2, 128).t(), None) is False
        monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True, raising=False)
        assert comp.rows_now("all_gather", x2, x, None) is False
        monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
        comp.broken = RuntimeError("an earlier failure")
        assert comp.rows_now("all_gather", x2, x, None) is False
        comp.broken = None
        assert seen == [] and comp.rows_now("all_gather", x2, x, None) is True and len(seen) == 1
        # the same shapes, the output of another dtype: the general path (it raises), not the cached plan
        assert comp.rows_now("all_gather", x2.bfloat16(), x, None) is False and len(seen) == 1

    _in_group(monkeypatch, test)


def test_a_repeated_call_with_its_graph_kept_launches_it_from_the_steady_state(monkeypatch):
    """all_reduce_now and rows_now, repeated on the same tensors once their graphs are
    kept, launch the graph on the group's stream and nothing else; each such op's replayed
    kernel reports an id that names it (the next sequence number, its collective), and the
    group's epochs and rounds advance as the kernel's own launch would advance them."""
    from chorus.cuda import layout as L
    from chorus.cuda import replays

    launched: list = []

    class Graphs:  # (a graph launch, recorded: exe and the raw stream it went on)
        def launch(self, exe, stream):
            launched.append((exe, stream.value))
            return 0

    def test(comp, seen):
        monkeypatch.setattr(launchers, "launch", lambda kernel, key, grid, args, warps, stream=None:
                            launchers._COMPILED.__setitem__(key, (None, 0, 0, None)))  # (compiled: a Shot is made)
        monkeypatch.setattr(launchers.Shot, "__call__", lambda self, *a: pytest.fail("the kernel launched"))
        comp._nccl_from = 1 << 40
        lanes = comp.lanes
        t, part, whole = torch.ones(256), torch.ones(128), torch.ones(256)
        calls = {"all_reduce": (lambda: comp.all_reduce_now(t, ReduceOp.SUM), t, t),
                 "all_gather": (lambda: comp.rows_now("all_gather", whole, part, None), part, whole),
                 "reduce_scatter": (lambda: comp.rows_now("reduce_scatter", part, whole, ReduceOp.SUM), whole, part)}
        for call, _, _ in calls.values():  # (each keeps its Shot)
            assert call() is True
        assert len(lanes.shots) == 3
        for exe, (shot, (_, inp, out)) in enumerate(zip(lanes.shots.values(), calls.values(), strict=True)):
            shot.replays = replays.Replays(shot, Graphs(), 0)
            for parity in (0, 1):
                shot.replays.kept[(inp.data_ptr(), out.data_ptr(), parity)] = 10 * exe + parity + 1
        seqs = []
        monkeypatch.setattr(lanes, "begin", lambda *a, **k: pytest.fail("begin() in the steady state"))
        for name, (call, _, _) in calls.items():
            for _ in range(2):
                rounds, epoch, kernels = lanes.rounds, lanes.epoch, len(seen)
                assert call() is True
                assert lanes.rounds == rounds + 1 and lanes.epoch > epoch and len(seen) == kernels
                entry = comp.names.entry(L.REPLAY_OP + epoch + 1)
                assert entry is not None and name in entry[0], (name, entry)
                seqs.append(entry[1])
        assert seqs == list(range(seqs[0], seqs[0] + 6))  # (each op's own sequence number)
        assert [stream for _, stream in launched] == [123] * 6  # (the group's stream: comp._last_raw)
        assert sorted(exe for exe, _ in launched) == [1, 2, 11, 12, 21, 22]

    _in_group(monkeypatch, test)


@pytest.mark.parametrize("state", ["status", "tag", "dead", "mismatched", "closed", "nccl"])
def test_the_lanes_raise_what_check_raises_for_every_failure_check_knows(monkeypatch, state):
    """all_reduce_now and rows_now write check()'s all-clear test out in place; for every
    state check() raises on (a kernel's report, a tag mismatch, a dead member, a mismatch
    or a closed transport, a broken NCCL communicator) each lane raises the same error."""
    from chorus.cuda import layout as L

    def set_state(comp, on: bool) -> None:
        t, words, gid = comp.pg.transport, comp.ws.words, comp.pg.id
        if state == "status":
            words[L.STATUS] = 1 if on else 0
        elif state == "tag":
            words[L.TAG_OP] = 1 if on else 0
        elif state == "dead":
            t.dead.update({comp.pg.members[0]: "killed"} if on else {})
            if not on:
                t.dead.clear()
        elif state == "mismatched":
            if on:
                t.mismatched[gid], t.mismatched_at[gid] = "another op", 0
            else:
                t.mismatched.pop(gid, None)
                t.mismatched_at.pop(gid, None)
        elif state == "closed":
            t.closed_reason = "closed here" if on else None
        else:
            comp._nccl = SimpleNamespace(broken=RuntimeError("NCCL communicator was aborted"),
                                         abort_soon=lambda: None) if on else None
        comp.broken, words[L.ABORT] = None, 0  # (check() marks the group broken: each call sees it afresh)

    def test(comp, seen):
        monkeypatch.setattr(launchers.Shot, "__call__", lambda self, *a: self.barriers)
        comp._nccl_from = 1 << 40
        t, part, whole = torch.ones(256), torch.ones(128), torch.ones(256)
        lanes = {"all_reduce": lambda: comp.all_reduce_now(t, ReduceOp.SUM),
                 "all_gather": lambda: comp.rows_now("all_gather", whole, part, None),
                 "reduce_scatter": lambda: comp.rows_now("reduce_scatter", part, whole, ReduceOp.SUM)}
        for call in lanes.values():  # (plans made, nothing wrong yet)
            assert call() is True
        set_state(comp, True)
        with pytest.raises(Exception) as by_check:
            comp.check("all_reduce")
        broken = comp.broken is not None  # (a tag mismatch raises without breaking the group)
        for name, call in lanes.items():
            set_state(comp, True)
            with pytest.raises(type(by_check.value)):
                call()
            assert (comp.broken is not None) == broken, name  # (the group left as check() leaves it)
        set_state(comp, False)
        for call in lanes.values():
            assert call() is True

    _in_group(monkeypatch, test)
