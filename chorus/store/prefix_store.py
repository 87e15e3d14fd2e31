"""``PrefixStore``: a view of another store whose keys all start with ``prefix + "/"``."""

from __future__ import annotations

from datetime import timedelta

from chorus.errors import InvalidArgumentError
from chorus.store.base import Store, check_key


class PrefixStore(Store):
    """Every key ``k`` is stored as ``f"{prefix}/{k}"`` in ``store``.

    Timeouts are the underlying store's (``set_timeout`` changes them there, as in
    torch), and ``num_keys`` counts every key of the underlying store.
    """

    def __init__(self, prefix: str, store: Store):
        if not isinstance(store, Store):
            raise InvalidArgumentError(
                f"PrefixStore needs a chorus Store to wrap, got {type(store).__name__}"
            )
        self.prefix = check_key(prefix)
        self._store = store

    @property
    def underlying_store(self) -> Store:
        """The wrapped store."""
        return self._store

    @property
    def timeout(self) -> timedelta:
        """The underlying store's default timeout."""
        return self._store.timeout

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Set the underlying store's default timeout."""
        self._store.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}"

    def set(self, key: str, value: bytes | str) -> None:
        """Set ``prefix/key``."""
        self._store.set(self._key(key), value)

    def get(self, key: str, timeout: timedelta | float | None = None) -> bytes:
        """Return the value of ``prefix/key``, waiting for it."""
        return self._store.get(self._key(key), timeout)

    def add(self, key: str, amount: int) -> int:
        """Add to counter ``prefix/key``; return the new value."""
        return self._store.add(self._key(key), amount)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Compare-and-set ``prefix/key``."""
        return self._store.compare_set(self._key(key), expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Wait until every ``prefix/key`` exists."""
        self._store.wait([self._key(k) for k in keys], timeout)

    def check(self, keys: list[str]) -> bool:
        """Return True if every ``prefix/key`` exists."""
        return self._store.check([self._key(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        """Delete ``prefix/key``; return True if it existed."""
        return self._store.delete_key(self._key(key))

    def num_keys(self) -> int:
        """Return the number of keys in the underlying store (all prefixes)."""
        return self._store.num_keys()

    def multi_get(self, keys: list[str], timeout: timedelta | float | None = None) -> list[bytes]:
        """Return the values of every ``prefix/key``, waiting until all exist."""
        return self._store.multi_get([self._key(k) for k in keys], timeout)

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Set every ``prefix/keys[i]`` to ``values[i]``."""
        self._store.multi_set([self._key(k) for k in keys], values)
