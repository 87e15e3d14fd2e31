"""``HashStore``: an in-process store for ranks that run as threads of one process."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from chorus.store.base import (
    DEFAULT_TIMEOUT,
    Store,
    add_to,
    check_key,
    compare_set_result,
    pair_up,
    timeout_error,
    to_value,
)


class HashStore(Store):
    """A dict guarded by a ``threading.Condition``; waiters sleep until a key is written."""

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT):
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def _wait_for(self, what: str, keys: list[str], timeout) -> None:
        """With the lock held, wait until every key exists or raise StoreTimeoutError."""
        seconds = self._seconds(timeout)
        deadline = time.monotonic() + seconds
        while True:
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise timeout_error(what, missing, seconds)
            self._cond.wait(min(remaining, threading.TIMEOUT_MAX))

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key`` and wake every waiter."""
        key, value = check_key(key), to_value(value)
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key: str, timeout: timedelta | float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` for it."""
        check_key(key)
        with self._cond:
            self._wait_for("get", [key], timeout)
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to counter ``key``; return the new value."""
        check_key(key)
        with self._cond:
            value = add_to(self._data.get(key), int(amount), key)
            self._data[key] = value
            self._cond.notify_all()
            return int(value)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return the resulting value."""
        check_key(key)
        with self._cond:
            new, result = compare_set_result(self._data.get(key), to_value(expected),
                                             to_value(desired))
            if new is not None:
                self._data[key] = new
                self._cond.notify_all()
            return result

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key exists (StoreTimeoutError after ``timeout``)."""
        keys = [check_key(k) for k in keys]
        with self._cond:
            self._wait_for("wait", keys, timeout)

    def check(self, keys: list[str]) -> bool:
        """Return True if every key exists."""
        with self._cond:
            return all(check_key(k) in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return True if it existed."""
        check_key(key)
        with self._cond:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        """Return the number of keys."""
        with self._cond:
            return len(self._data)

    def multi_get(self, keys: list[str], timeout: timedelta | float | None = None) -> list[bytes]:
        """Return the values of ``keys`` (read together), waiting until all exist."""
        keys = [check_key(k) for k in keys]
        with self._cond:
            self._wait_for("multi_get", keys, timeout)
            return [self._data[k] for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Set every ``keys[i]`` to ``values[i]`` at once."""
        items = pair_up(keys, values)
        with self._cond:
            self._data.update(items)
            self._cond.notify_all()
