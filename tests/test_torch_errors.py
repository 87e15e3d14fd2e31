"""chorus's errors as torch.distributed's (chorus.torch.errors): same object, both classes."""

from __future__ import annotations

import pickle

import pytest

from chorus import errors

pytest.importorskip("torch", reason="chorus.torch needs torch (pip install 'chorus[torch]')")

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
