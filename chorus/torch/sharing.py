"""Moving tensors that a group all-reduces (or sends all-to-all) again and again into shared memory.

DDP all-reduces the same gradient buckets every step.  When such a tensor's storage
lives in a shared file, the ranks of a host map each other's buckets and all-reduce them
with one read and one write of every byte (chorus.shm.mapped) instead of copying them
through the window.  torch can move a CPU storage into shared memory in place — the
same storage object, so every view of it (DDP's bucket views, ``gradient_as_bucket_view``
gradients) follows — with the machinery behind ``Tensor.share_memory_()``.

:class:`Sharing` does that for one group, at the second all_reduce of a storage of at
least ``SHARE_BYTES`` (a tensor all-reduced once is not worth the copy), when:

- the group's members share memory and map each other's buffers (chorus.shm.mapped);
- no op of this group issued earlier still uses the storage (its memory moves);
- ``/dev/shm``, where torch puts the file, has room for it twice over.

The storage is then registered (chorus.shm.registered) for as long as it lives.
``all_to_all_single`` offers its input the same way (the peers read it in place).  A
storage already in shared memory (``share_memory_()``, a DataLoader worker's batch) is
registered at its first all_reduce.  ``CHORUS_TORCH_SHARE=0`` turns this off; another
group using the same tensor at the same time is not checked (torch forbids touching a
tensor while an async op on it is in flight).
"""

from __future__ import annotations

import os
import weakref

from chorus.shm import mapped, registered
from chorus.shm.settings import env_int

#: Storages of at least this many bytes are moved (``CHORUS_TORCH_SHARE_BYTES``).
SHARE_BYTES = env_int("CHORUS_TORCH_SHARE_BYTES", 1 << 20)
ENABLED = env_int("CHORUS_TORCH_SHARE", 1) != 0
_SHM_DIR = "/dev/shm"
_SEEN_MAX = 4096


class Sharing:
    """Which storages of a chorus torch group to move into shared memory (see above)."""

    def __init__(self, chorus_pg):
        self._pg = chorus_pg
        self._seen: dict[int, tuple] = {}  # storage address -> (weak reference to the storage, all_reduces seen)
        self._inflight: dict[int, list] = {}  # storage address -> [the work last issued on it]

    def wanted(self, t, op: str = "all_reduce") -> bool:
        """Whether ``op`` (all_reduce, all_to_all) on tensor ``t`` could use a registered buffer."""
        shm = self._pg.shm
        return (ENABLED and shm is not None and t.is_cpu and t.is_contiguous()
                and t.untyped_storage().nbytes() >= max(SHARE_BYTES, 1) and mapped.use(shm.window, t.nbytes, op))

    def offer(self, t, op: str = "all_reduce") -> None:
        """Before ``op`` on ``t``: register its storage, moving it if it is reused."""
        if not self.wanted(t, op):
            return
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if registered.find_start(address):
            return
        if not storage.is_shared():
            ref, seen = self._seen.get(address, (None, 0))
            if ref is None or ref() is not storage:  # a new storage where another one was: not reused
                ref, seen = weakref.ref(storage), 0
            works = self._inflight.get(address, ())
            if seen == 0 or not all(w.is_completed() for w in works) or not _room(storage.nbytes()):
                if len(self._seen) >= _SEEN_MAX:
                    self._seen.clear()
                self._seen[address] = ref, seen + 1
                return
        try:
            fd, _ = storage._share_fd_cpu_()
        except RuntimeError:  # shared by file name, or torch refused: stay on the copy path
            return
        self._seen.pop(address, None)
        self._inflight.pop(address, None)
        alive = weakref.ref(storage)
        registered.register(storage.data_ptr(), storage.nbytes(), fd, lambda: alive() is not None)

    def issued(self, tensors, work, op: str = "all_reduce") -> None:
        """Remember ``work``, an async ``op`` on ``tensors`` (their storages are busy until it is done)."""
        for t in tensors:
            if self.wanted(t, op):
                address = t.untyped_storage().data_ptr()
                if not registered.find_start(address):
                    if len(self._inflight) >= _SEEN_MAX:
                        self._inflight.clear()
                    self._inflight[address] = [work]


def _room(nbytes: int) -> bool:
    try:
        info = os.statvfs(_SHM_DIR)
    except OSError:
        return False
    return info.f_bavail * info.f_frsize >= 2 * nbytes
