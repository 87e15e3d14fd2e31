"""Moving tensors that a group all-reduces (or sends all-to-all) again and again into shared memory.

DDP all-reduces the same gradient buckets every step.  When such a tensor's storage
lives in a shared file, the ranks of a host map each other's buckets and all-reduce them
with one read and one write of every byte (chorus.shm.mapped) instead of copying them
through the window.  torch can move a CPU storage into shared memory in place — the
same storage object, so every view of it (DDP's bucket views, ``gradient_as_bucket_view``
gradients) follows — with the machinery behind ``Tensor.share_memory_()``.

:class:`Sharing` does that for one group, at the second all_reduce of a storage of at
least ``CHORUS_TORCH_SHARE_BYTES`` (1 MiB; a tensor all-reduced once is not worth the
copy), when:

- the group's members share memory and map each other's buffers (chorus.shm.mapped), and
  the op would use them (its size; not a one-shot message);
- the storage is an ordinary one of torch's allocator (resizable, not shared yet): one
  made from a numpy array, a file or another process's memory is left alone, since
  moving it would end its sharing;
- no async op of this group issued earlier still uses the storage (its memory moves);
- ``/dev/shm``, where torch puts the file, has room for every local rank's copy, twice.

The storage is then registered (chorus.shm.registered) for as long as it lives.
``all_to_all_single`` offers its input the same way (the peers read it in place).
``CHORUS_TORCH_SHARE=0`` turns this off (both settings are read when the group is
created).  Not checked: another group using the same tensor at the same time (torch
forbids touching a tensor while an async op on it is in flight).  A moved storage can
no longer be resized.
"""

from __future__ import annotations

import logging
import os
import weakref

import numpy as np

from chorus import config
from chorus.shm import collectives as shm_collectives
from chorus.shm import mapped, registered

log = logging.getLogger("chorus.torch")

_SHM_DIR = "/dev/shm"
_SEEN_MAX = 4096
_BYTES = np.dtype(np.uint8)


class _Memory:
    """A tensor's memory as numpy sees it (``__array_interface__``), keeping the tensor alive."""

    def __init__(self, t, typestr: str):
        self.tensor = t
        self.__array_interface__ = {"data": (t.data_ptr(), False), "shape": (t.numel(),),
                                    "typestr": typestr, "version": 3}


_TYPESTR: dict = {}  # torch dtype -> numpy's type string


def unmarked_view(t) -> np.ndarray:
    """A numpy view of contiguous CPU tensor ``t`` that, unlike ``t.numpy()``, leaves its
    storage resizable: so that "not resizable" keeps meaning that the *caller* shares the
    storage with numpy (or a file), and such a storage is never moved (see above)."""
    typestr = _TYPESTR.get(t.dtype)
    if typestr is None:
        import torch

        typestr = _TYPESTR[t.dtype] = torch.empty(0, dtype=t.dtype).numpy().dtype.str
    return np.asarray(_Memory(t, typestr)).reshape(t.shape)


class Sharing:
    """Which storages of a chorus torch group to move into shared memory (see above)."""

    def __init__(self, chorus_pg):
        self._pg = chorus_pg
        self._seen: dict[int, tuple] = {}  # storage address -> (weak reference to the storage, ops seen)
        self._pending: list[tuple[frozenset, object]] = []  # (storage addresses, work) of async ops
        self._no_room_said = False
        self.enabled = config.get("CHORUS_TORCH_SHARE")
        self.share_bytes = config.get("CHORUS_TORCH_SHARE_BYTES")  # storages of at least this size move

    def active(self) -> bool:
        """Whether this group could use registered buffers at all."""
        shm = self._pg.shm
        return self.enabled and shm is not None and shm.window.maps is not None

    def wanted(self, t, op: str = "all_reduce") -> bool:
        """Whether ``op`` (all_reduce, all_to_all) on tensor ``t`` could use a registered buffer."""
        if not (self.active() and t.is_cpu and t.is_contiguous()):
            return False
        shm = self._pg.shm
        if not mapped.use(shm.window, t.nbytes, op):
            return False
        if op != "all_to_all" and shm_collectives.one_shot(shm.window, _BYTES, t.nbytes):
            return False  # one-shot messages never offer their buffer
        return t.untyped_storage().nbytes() >= max(self.share_bytes, 1)

    def offer(self, t, op: str = "all_reduce") -> None:
        """Before ``op`` on ``t``: register its storage, moving it there if it is reused.
        Never raises: whatever goes wrong leaves the tensor where it was (the copy path)."""
        try:
            if self.wanted(t, op):
                self._offer(t.untyped_storage())
        except Exception as exc:  # noqa: BLE001 - an optimisation; the op itself goes on
            log.debug("chorus.torch: tensor not moved into shared memory: %s", exc)

    def _offer(self, storage) -> None:
        address = storage.data_ptr()
        if registered.find_start(address):
            return
        if storage.is_shared() or not storage.resizable():
            return  # not torch's own allocation (numpy's, a file's, another process's): leave it
        ref, seen = self._seen.get(address, (None, 0))
        if ref is None or ref() is not storage:  # a new storage where another one was: not reused
            ref, seen = weakref.ref(storage), 0
        if seen == 0 or self._busy(address) or not self._room(storage.nbytes()):
            if len(self._seen) >= _SEEN_MAX:
                self._seen.clear()
            self._seen[address] = ref, seen + 1
            return
        fd, _ = storage._share_fd_cpu_()
        self._seen.pop(address, None)
        if fd < 0:
            return
        registered.register(storage.data_ptr(), storage.nbytes(), fd, lambda: ref() is not None)

    def issued(self, tensors, work) -> None:
        """Remember ``work``, an async op on ``tensors``: their storages are busy until it is done
        (nothing to remember where no storage ever moves)."""
        if not self.active():
            return
        self._prune()
        addresses = frozenset(t.untyped_storage().data_ptr() for t in tensors if t.is_cpu)
        if addresses:
            self._pending.append((addresses, work))

    def _busy(self, address: int) -> bool:
        self._prune()
        return any(address in addresses for addresses, _ in self._pending)

    def _prune(self) -> None:
        """Forget completed ops (and with them the tensors their works hold)."""
        if self._pending:
            self._pending = [(a, w) for a, w in self._pending if not w.is_completed()]

    def _room(self, nbytes: int) -> bool:
        """Room in /dev/shm for every local rank's copy of such a storage, twice over."""
        try:
            info = os.statvfs(_SHM_DIR)
        except OSError:
            return False
        ok = info.f_bavail * info.f_frsize >= 2 * self._pg.shm.window.world * nbytes
        if not ok and not self._no_room_said:
            self._no_room_said = True
            log.warning("chorus.torch: %s has too little room to move tensors of %d bytes into shared memory; "
                        "they stay on the copy path", _SHM_DIR, nbytes)
        return ok
