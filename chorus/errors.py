"""The errors chorus raises.  Every one derives from :class:`ChorusError`.

Errors about bad input also derive from the built-in ``ValueError`` or ``TypeError``
(and timeouts from ``TimeoutError``) so that code written against torch.distributed,
which raises those built-ins, keeps catching them.

Each message says what happened, to which op and ranks, and what to do next.

Where chorus runs as a torch backend (``chorus.torch``), the errors that leave it are also
torch's ``DistBackendError`` / ``DistNetworkError`` / ``DistStoreError``
(``chorus/torch/errors.py``); this module does not import torch.
"""

from __future__ import annotations

import pickle


class ChorusError(RuntimeError):
    """Root of every error chorus raises."""


class InvalidArgumentError(ChorusError, ValueError):
    """A call's arguments are wrong (rank out of range, bad init method, ...).

    Raised before anything is sent.
    """


class InvalidTensorError(ChorusError, TypeError):
    """An object passed as a tensor is neither a numpy array nor a torch CPU tensor."""


class NotInitializedError(ChorusError, ValueError):
    """An op was called before ``init_process_group`` (or after ``destroy_process_group``)."""


class RendezvousError(ChorusError):
    """The ranks could not find each other (store unreachable, address in use, ...)."""


class StoreTimeoutError(ChorusError, TimeoutError):
    """A store ``get``/``wait`` did not see its keys before the deadline."""


class CommTimeoutError(ChorusError, TimeoutError):
    """A communication op did not finish before the group's (or the call's) timeout."""


class PeerLostError(ChorusError):
    """A peer process died or left; every pending and later op of its groups fails.

    ``lost_rank`` is the global rank of the peer that was lost and ``reporter`` the
    rank that noticed it first (which may be this rank).
    """

    def __init__(self, message: str, lost_rank: int | None = None, reporter: int | None = None):
        super().__init__(message)
        self.lost_rank = lost_rank
        self.reporter = reporter


class ProtocolError(ChorusError):
    """A peer sent bytes that are not a valid chorus frame (wrong magic or version, ...)."""


class AuthenticationError(ChorusError):
    """A connection did not prove knowledge of the job token."""


class UnsafeObjectError(ChorusError, pickle.UnpicklingError):
    """A peer's pickled object needs a global that is not on the allow-list of safe
    globals (``chorus.add_safe_globals``); nothing of it was run.

    ``global_name`` is the refused ``module.name``, ``op`` the object collective and
    ``sender`` the global rank that sent the object (None if not known).  Also a
    ``pickle.UnpicklingError``, as ``torch.load(weights_only=True)`` raises.
    """

    def __init__(self, message: str, global_name: str = "", op: str = "", sender: int | None = None):
        super().__init__(message)
        self.global_name = global_name
        self.op = op
        self.sender = sender


class BufferMismatchError(ChorusError, ValueError):
    """A received message does not fit the posted buffer (dtype or size differ)."""


class CollectiveMismatchError(ChorusError):
    """Ranks of one group called different collectives at the same sequence number.

    The message names each distinct call and the ranks that made it.  ``group`` is the
    group's id and ``expect`` this rank's (op number, fingerprint) where it raised (None
    if not known, or outside a collective).
    """

    def __init__(self, message: str, group: int | None = None, expect: tuple[int, int] | None = None):
        super().__init__(message)
        self.group = group
        self.expect = expect


class ConcurrentCallError(ChorusError):
    """A thread called a collective on a group while another thread of this rank was
    inside one of that group's collectives."""


class AbortedError(ChorusError):
    """The process group was aborted or destroyed while the op was pending."""


class DeadlockError(CommTimeoutError):
    """Ranks wait in point-to-point sends for each other in a cycle (with
    ``CHORUS_SEND_MODE=rendezvous``), so none of them can go on; the message names every
    rank of the cycle.

    On torch.distributed the same program hangs until its timeout, hence a
    :class:`CommTimeoutError` (and so a ``TimeoutError``) too.
    """
