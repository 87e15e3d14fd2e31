"""Two store adapters, one for each direction between chorus and torch.distributed.

``ChorusView(torch_store)``
    a chorus :class:`~chorus.store.Store` over a ``torch.distributed.Store``.  The
    backend rendezvouses its transport through the store torch hands to every new
    process group (torchrun's agent store, an ``env://`` TCPStore, a FileStore, ...)::

        torch's PrefixStore("<group>/cpu/") --ChorusView--> TcpTransport(rank, size, store)

``TorchView(chorus_store)``
    a ``torch.distributed.Store`` (a Python subclass torch calls through its C++
    trampoline) over a chorus store.  Under ``chorusrun`` the launcher hosts a *chorus*
    TCPStore; ``chorus.torch`` hands torch this view of it, so that torch's groups and
    chorus's share one store (see ``chorus.torch.rendezvous``).  Gloo and the chorus
    backend both work through it.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from chorus.store.base import DEFAULT_TIMEOUT, Store, to_value
from chorus.torch.errors import as_torch_error


class ChorusView(Store):
    """chorus's Store interface over a torch.distributed Store (keys and values unchanged).

    torch's ``get`` has no per-call timeout; a timeout given to ``get``/``multi_get`` is
    applied through ``wait`` first.
    """

    def __init__(self, torch_store: dist.Store):
        super().__init__(_timeout_of(torch_store))
        self.torch_store = torch_store

    def set(self, key: str, value: bytes | str) -> None:
        self.torch_store.set(key, to_value(value))

    def get(self, key: str, timeout: timedelta | float | None = None) -> bytes:
        if timeout is not None:
            self.wait([key], timeout)
        return bytes(self.torch_store.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self.torch_store.add(key, int(amount)))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return bytes(self.torch_store.compare_set(key, to_value(expected), to_value(desired)))

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        self.torch_store.wait(list(keys), timedelta(seconds=self._seconds(timeout)))

    def check(self, keys: list[str]) -> bool:
        return bool(self.torch_store.check(list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self.torch_store.delete_key(key))

    def num_keys(self) -> int:
        return int(self.torch_store.num_keys())

    def multi_get(self, keys: list[str], timeout: timedelta | float | None = None) -> list[bytes]:
        self.wait(keys, timeout)
        return [bytes(v) for v in self.torch_store.multi_get(list(keys))]


def _timeout_of(torch_store) -> timedelta:
    timeout = getattr(torch_store, "timeout", None)
    return timeout if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 else DEFAULT_TIMEOUT


class TorchView(dist.Store):
    """A torch.distributed Store whose keys live in a chorus store (e.g. chorusrun's).

    torch calls these methods from C++ (gloo's rendezvous included) through its Python
    store trampoline; each one forwards to the chorus store, which raises chorus's
    StoreTimeoutError (a TimeoutError, and torch's DistStoreError) naming the missing keys.
    """

    def __init__(self, chorus_store: Store):
        super().__init__()
        self.chorus_store = chorus_store

    def set(self, key: str, value) -> None:
        self.chorus_store.set(key, to_value(value))

    def get(self, key: str) -> bytes:
        try:
            return self.chorus_store.get(key, self._wait_limit())
        except BaseException as exc:
            as_torch_error(exc)  # a StoreTimeoutError is torch's DistStoreError too
            raise

    def add(self, key: str, value: int) -> int:
        return self.chorus_store.add(key, value)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.chorus_store.compare_set(key, to_value(expected), to_value(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        try:
            self.chorus_store.wait(list(keys), self._wait_limit() if timeout is None else timeout)
        except BaseException as exc:
            as_torch_error(exc)
            raise

    def check(self, keys: list[str]) -> bool:
        return self.chorus_store.check(list(keys))

    def delete_key(self, key: str) -> bool:
        return self.chorus_store.delete_key(key)

    def num_keys(self) -> int:
        return self.chorus_store.num_keys()

    def _wait_limit(self) -> timedelta:
        # torch's Store.timeout is what init_process_group(timeout=) set (set_timeout).
        timeout = self.timeout
        return timeout if timeout.total_seconds() > 0 else self.chorus_store.timeout


def tcp_address(torch_store) -> tuple[str, int] | None:
    """(host, port) of the torch TCPStore under ``torch_store`` (through PrefixStores), or
    None when it is another kind of store."""
    for _ in range(16):
        if isinstance(torch_store, dist.TCPStore):
            return torch_store.host, torch_store.port
        torch_store = getattr(torch_store, "underlying_store", None)
        if torch_store is None:
            return None
    return None


def agent_store(host: str, port: int, world_size: int, timeout: timedelta, prefix: str) -> Store:
    """A chorus store over the torch TCPStore that torchrun's agent serves on HOST:PORT
    (``TORCHELASTIC_USE_AGENT_STORE=True``), under ``prefix``: chorus scripts under torchrun
    share its store instead of opening a second one on its port."""
    from chorus.store.prefix_store import PrefixStore

    client = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    return PrefixStore(prefix, ChorusView(client))
