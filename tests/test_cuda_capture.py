"""What chorus.cuda allows inside a CUDA graph capture, decided on the host (the kernels'
device-side counting: tests/test_cuda_kernels.py, tests/test_cuda_algorithms.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from chorus.cuda import capture, component  # noqa: E402
from chorus.errors import InvalidArgumentError  # noqa: E402


@pytest.mark.parametrize("algorithm", sorted(capture.CAPTURABLE_ALL_REDUCE))
def test_all_reduce_is_capturable(algorithm):
    capture.check("all_reduce", algorithm, "g0")


@pytest.mark.parametrize("name, algorithm", [("broadcast", "one_shot"), ("all_gather", "fused"),
                                             ("all_reduce", "copy_reduce"), ("all_reduce", "staging"),
                                             ("send", ""), ("barrier", "barrier")])
def test_other_ops_are_refused_before_anything_is_enqueued(name, algorithm):
    with pytest.raises(InvalidArgumentError, match=rf"{name}.* on group g0 cannot be captured in a CUDA graph.*"
                                                   rf"run {name} outside the capture"):
        capture.check(name, algorithm, "g0")


def test_a_groups_first_cuda_call_inside_a_capture_says_to_warm_up(monkeypatch):
    monkeypatch.setattr(capture, "capturing", lambda: True)
    with pytest.raises(InvalidArgumentError, match="first CUDA collective on group g7 is inside a CUDA graph capture"
                                                   ".*before capturing"):
        component.attach(SimpleNamespace(name="g7", id=7))


def test_not_capturing_without_a_capture():
    assert capture.capturing() is False
