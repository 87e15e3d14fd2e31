"""chorus's errors as torch.distributed's (chorus.torch.errors): same object, both classes."""

from __future__ import annotations

import pickle

import pytest

from chorus import errors

pytest.importorskip("torch", reason="chorus.torch needs torch (pip install 'chorus[torch]')")

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

from chorus.shm.cma import PeerGone  # noqa: E402
from chorus.torch.errors import as_torch_error  # noqa: E402


@pytest.mark.parametrize("chorus_cls, torch_cls", [
    (errors.PeerLostError, tdist.DistBackendError),
    (errors.CommTimeoutError, tdist.DistBackendError),
    (errors.CollectiveMismatchError, tdist.DistBackendError),
    (errors.AbortedError, tdist.DistBackendError),
    (errors.RendezvousError, tdist.DistNetworkError),
    (errors.AuthenticationError, tdist.DistNetworkError),
    (errors.StoreTimeoutError, tdist.DistStoreError),
])
def test_a_chorus_error_becomes_also_torchs_in_place(chorus_cls, torch_cls):
    exc = chorus_cls("all_reduce (seq 3) on group 0: Timed out")
    assert as_torch_error(exc) is exc
    assert isinstance(exc, chorus_cls) and isinstance(exc, torch_cls) and isinstance(exc, errors.ChorusError)
    assert str(exc) == "all_reduce (seq 3) on group 0: Timed out"
    again = pickle.loads(pickle.dumps(exc))  # spawn and chorusrun send a rank's error to the parent
    assert type(again) is type(exc) and str(again) == str(exc)


def test_attributes_survive_and_timeouts_stay_timeouts():
    lost = as_torch_error(errors.PeerLostError("rank 1 left", lost_rank=1, reporter=0))
    assert (lost.lost_rank, lost.reporter) == (1, 0)
    assert isinstance(as_torch_error(errors.CommTimeoutError("x")), TimeoutError)
    assert isinstance(as_torch_error(errors.StoreTimeoutError("x")), TimeoutError)


def test_internal_subclasses_become_the_public_class_and_others_are_left_alone():
    gone = as_torch_error(PeerGone("peer 2 exited"))
    assert type(gone).__name__ == "PeerLostError" and isinstance(gone, tdist.DistBackendError)
    bad_arg = errors.InvalidArgumentError("rank 9 out of range")
    assert type(as_torch_error(bad_arg)) is errors.InvalidArgumentError  # a ValueError, as torch raises
    plain = KeyError("k")
    assert as_torch_error(plain) is plain and type(plain) is KeyError


def test_a_cuda_all_reduce_takes_the_device_lane_straight_and_its_errors_leave_as_torchs():
    """ChorusProcessGroup's all_reduce of one CUDA tensor calls the CUDA component's lane
    without the chorus API between (a queued op: TorchWork of its Work; a synchronous one:
    a finished TorchWork); a lane that steps aside sends it the general way (None), and the
    lane's chorus errors reach the caller as torch's."""
    from types import SimpleNamespace

    from chorus.api.state import current
    from chorus.reductions import ReduceOp
    from chorus.torch.backend import ChorusProcessGroup
    from chorus.work import Work

    queued, answers, seen = Work([]), [], []

    def all_reduce_now(t, op, async_op):
        seen.append((op, async_op))
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    lane = SimpleNamespace(all_reduce_now=all_reduce_now)
    group = SimpleNamespace(_pg=SimpleNamespace(device_components={"cuda": lane}), _world=current())
    straight = ChorusProcessGroup._cuda_all_reduce_now
    t = torch.ones(2)
    answers[:] = [queued, True, False, errors.PeerLostError("rank 1 is gone", 1)]
    work = straight(group, t, ReduceOp.SUM, True, None)
    assert work._works == [queued] and work._result == [t]
    done = straight(group, t, ReduceOp.AVG, False, None)
    assert done.is_completed() and done._works == []
    assert straight(group, t, ReduceOp.SUM, False, None) is None
    with pytest.raises(tdist.DistBackendError, match="rank 1 is gone"):
        straight(group, t, ReduceOp.SUM, False, None)
    assert seen == [(ReduceOp.SUM, True), (ReduceOp.AVG, False), (ReduceOp.SUM, False), (ReduceOp.SUM, False)]
    none = SimpleNamespace(_pg=SimpleNamespace(device_components={}), _world=current())
    assert straight(none, t, ReduceOp.SUM, True, None) is None


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on a GPU (the backend's CUDA branch, without one)."""

    @property
    def is_cuda(self):
        return True


def test_a_cuda_all_reduce_asks_the_device_lane_once_under_one_profiler_event(monkeypatch):
    """ChorusProcessGroup.allreduce of one CUDA tensor: the lane takes it (no general
    path), or steps aside and the general path runs without asking the lane again; either
    way one profiler event, opened once, covers the op."""
    import functools
    from types import SimpleNamespace

    from chorus.api.state import current
    from chorus.torch import backend
    from chorus.torch.backend import ChorusProcessGroup as CPG

    log: list[str] = []

    class Recording:
        def __init__(self, name, tensors):
            log.append(f"event {name} opened")

        def close(self):
            log.append("event closed")

    monkeypatch.setattr(backend, "profiling", lambda: True)
    monkeypatch.setattr(backend, "Recording", Recording)
    monkeypatch.setattr(backend, "_all_reduce", lambda *a: log.append("general path, lanes first"))
    monkeypatch.setattr(backend, "_all_reduce_general", lambda *a: log.append("general path"))
    takes = []
    lane = SimpleNamespace(all_reduce_now=lambda t, op, a: log.append("lane asked") or takes.pop(0))
    group = SimpleNamespace(_pg=SimpleNamespace(device_components={"cuda": lane}), _world=current(),
                            _sharing=SimpleNamespace(offer=lambda t: None, share_bytes=1 << 60,
                                                     issued=lambda ts, w: None),
                            _name_in_torch=lambda: "chorus")
    for name in ("_cuda_all_reduce_now", "_issue", "_start", "_record"):
        setattr(group, name, functools.partial(getattr(CPG, name), group))
    t = torch.Tensor._make_subclass(_OnCuda, torch.ones(4))
    opts = SimpleNamespace(reduceOp=tdist.ReduceOp.SUM, asyncOp=False)
    takes[:] = [True, False]
    CPG.allreduce(group, [t], opts)
    taken = list(log)
    log.clear()
    CPG.allreduce(group, [t], opts)
    assert taken == ["event chorus:all_reduce opened", "lane asked", "event closed"], taken
    assert log == ["event chorus:all_reduce opened", "lane asked", "general path", "event closed"], log


def test_a_handed_off_works_wait_raises_the_groups_error_where_nccls_wait_fails():
    """CudaWork of an op NCCL ran: wait() is NCCL's; where that raises because chorus broke
    the group (NCCL's communicator aborted), chorus's error, naming the ops, is raised."""
    from chorus.cuda.work import CudaWork

    def nccls_wait():
        raise RuntimeError("NCCL communicator was aborted")

    def check():
        raise errors.CollectiveMismatchError("all_reduce: rank 1 called all_gather")

    native = type("Native", (), {"wait": staticmethod(nccls_wait)})()
    with pytest.raises(errors.CollectiveMismatchError, match="all_gather"):
        CudaWork(lambda: None, check, [], (), native).wait()
    fine = type("Native", (), {"wait": staticmethod(lambda: None)})()
    assert CudaWork(lambda: None, lambda: None, [], (), fine).wait() is True
