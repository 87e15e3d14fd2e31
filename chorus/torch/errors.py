"""chorus's errors as torch.distributed's, where chorus runs as a torch backend.

torch raises ``DistBackendError`` when a collective fails, ``DistNetworkError`` when
ranks cannot connect and ``DistStoreError`` when a store times out or fails; code written
for torch catches those.  chorus's core does not import torch, so it raises its own classes
(``chorus.errors``).  At the torch adapter's boundary (a ``ChorusProcessGroup`` method, a
``TorchWork``'s wait or future, the backend's creator, the stores torch calls), each chorus
error becomes an instance of a class that derives from both, defined below::

    chorus.errors             chorus.torch.errors         also a torch.distributed
    PeerLostError         ->  PeerLostError           ->  DistBackendError
    CommTimeoutError      ->  CommTimeoutError        ->  DistBackendError (and TimeoutError)
    StoreTimeoutError     ->  StoreTimeoutError       ->  DistStoreError   (and TimeoutError)
    RendezvousError       ->  RendezvousError         ->  DistNetworkError

So ``except dist.DistBackendError``, ``except chorus.PeerLostError`` and ``except
TimeoutError`` all catch the same error.  The conversion changes the object's class in
place: message, attributes (``lost_rank``), traceback and cause stay as they were.  Errors
about the caller's arguments (``InvalidArgumentError``: a ``ValueError``, as torch raises
for them) are left alone.
"""

from __future__ import annotations

import torch.distributed as dist

from chorus import errors


class PeerLostError(errors.PeerLostError, dist.DistBackendError):
    """A peer died or left (chorus's ``PeerLostError``, torch's ``DistBackendError``)."""


class CommTimeoutError(errors.CommTimeoutError, dist.DistBackendError):
    """An op timed out (chorus's ``CommTimeoutError``, torch's ``DistBackendError``)."""


class CollectiveMismatchError(errors.CollectiveMismatchError, dist.DistBackendError):
    """Ranks called different collectives (also torch's ``DistBackendError``)."""


class ConcurrentCallError(errors.ConcurrentCallError, dist.DistBackendError):
    """Two threads in one group's collectives (also torch's ``DistBackendError``)."""


class AbortedError(errors.AbortedError, dist.DistBackendError):
    """The group was aborted or destroyed (also torch's ``DistBackendError``)."""


class BufferMismatchError(errors.BufferMismatchError, dist.DistBackendError):
    """A message did not fit the posted buffer (also torch's ``DistBackendError``)."""


class ProtocolError(errors.ProtocolError, dist.DistNetworkError):
    """A peer sent bytes that are not chorus frames (also torch's ``DistNetworkError``)."""


class AuthenticationError(errors.AuthenticationError, dist.DistNetworkError):
    """A connection did not prove the job token (also torch's ``DistNetworkError``)."""


class RendezvousError(errors.RendezvousError, dist.DistNetworkError):
    """The ranks could not find each other (also torch's ``DistNetworkError``)."""


class StoreTimeoutError(errors.StoreTimeoutError, dist.DistStoreError):
    """A store wait timed out (chorus's ``StoreTimeoutError``, torch's ``DistStoreError``)."""


_TORCH_FLAVOUR: dict[type, type] = {
    errors.PeerLostError: PeerLostError,
    errors.CommTimeoutError: CommTimeoutError,
    errors.CollectiveMismatchError: CollectiveMismatchError,
    errors.ConcurrentCallError: ConcurrentCallError,
    errors.AbortedError: AbortedError,
    errors.BufferMismatchError: BufferMismatchError,
    errors.ProtocolError: ProtocolError,
    errors.AuthenticationError: AuthenticationError,
    errors.RendezvousError: RendezvousError,
    errors.StoreTimeoutError: StoreTimeoutError,
}


def as_torch_error(exc: BaseException) -> BaseException:
    """``exc`` itself, now also of torch's class (see the module docstring) if it is one of
    chorus's errors above or an internal subclass of one (which becomes the public class);
    any other exception unchanged."""
    if isinstance(exc, dist.DistError) or not isinstance(exc, errors.ChorusError):
        return exc
    for cls in type(exc).__mro__:
        flavour = _TORCH_FLAVOUR.get(cls)
        if flavour is not None:
            exc.__class__ = flavour
            break
    return exc
