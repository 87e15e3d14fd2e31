"""A synchronous all_reduce of a torch CPU tensor takes the shared-memory window's latency
lane through a numpy view of the tensor's memory (chorus.components.shm,
``all_reduce_tensor_now``): the same results as the general path; tensors numpy has no
view of (bfloat16) and non-contiguous ones go the general path."""

from __future__ import annotations

import pytest

import chorus as dist
from chorus.testing import run_threads

torch = pytest.importorskip("torch")


def _lane_ops() -> int:
    """all_reduce ops the default group's lane ran so far (its flight-recorder list)."""
    return len(dist.group.WORLD.lane.reduce_log)


def test_torch_tensors_take_the_lane_with_the_general_path_s_results():
    def body(rank, world):
        out = {}
        t = torch.full((4,), float(rank + 1))
        before = _lane_ops()
        dist.all_reduce(t)
        dist.all_reduce(t)  # the same tensor again: its kept view
        out["lane"] = _lane_ops() - before
        out["sum"] = t.tolist()
        i = torch.arange(6, dtype=torch.int64) * (rank + 1)
        dist.all_reduce(i, op=dist.ReduceOp.MAX)
        out["max"] = i.tolist()
        a = torch.full((3,), float(rank))
        dist.all_reduce(a, op=dist.ReduceOp.AVG)
        out["avg"] = a.tolist()
        s = torch.tensor(float(rank + 1))  # 0-d
        dist.all_reduce(s)
        out["scalar"] = s.item()
        t.resize_(2)  # the same tensor object, fewer elements: a view of its new size
        dist.all_reduce(t)
        out["resized"] = t.tolist()
        t.set_(torch.full((3,), float(rank + 1)))  # the same tensor object on new memory
        dist.all_reduce(t)
        out["set"] = t.tolist()
        out["lane_all"] = _lane_ops() - before
        before = _lane_ops()
        b = torch.full((4,), float(rank + 1), dtype=torch.bfloat16)  # numpy has no bfloat16
        dist.all_reduce(b)
        base = torch.arange(8.0) * (rank + 1)
        dist.all_reduce(base[::2])  # a strided view: only its elements change
        out["general"] = (_lane_ops() - before, b.tolist(), base.tolist())
        return out

    got = run_threads(body, 2)
    for out in got:
        assert out["lane"] == 2
        assert out["sum"] == [6.0] * 4  # (1 + 2), twice: 3 + 3
        assert out["max"] == [0, 2, 4, 6, 8, 10]
        assert out["avg"] == [0.5] * 3
        assert out["scalar"] == 3.0
        assert out["resized"] == [12.0, 12.0]
        assert out["set"] == [3.0] * 3
        assert out["lane_all"] == 7  # every call above
        lane, b, base = out["general"]
        assert lane == 0  # neither took the lane ...
        assert b == [3.0] * 4  # ... and both are right
        assert base[::2] == [0.0, 6.0, 12.0, 18.0] and base[1::2] in ([1.0, 3.0, 5.0, 7.0], [2.0, 6.0, 10.0, 14.0])
