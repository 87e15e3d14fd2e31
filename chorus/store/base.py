"""``Store``: the key-value store that ranks rendezvous through (torch.distributed.Store).

Keys are str, values bytes (a str value is stored as its UTF-8 encoding).  ``get`` and
``wait`` block until their keys exist, up to the call's timeout or the store's
(``timeout``, 300 s by default), then raise StoreTimeoutError naming the missing keys.
Timeouts are ``datetime.timedelta`` or float seconds.

The value helpers below (``add_to``, ``compare_set_result``) are shared by every store
and by the TCP store server, so that they all agree on torch's semantics.
"""

from __future__ import annotations

import abc
import numbers
from collections.abc import Sequence
from datetime import timedelta

from chorus.errors import InvalidArgumentError, StoreTimeoutError

DEFAULT_TIMEOUT = timedelta(seconds=300)


def to_seconds(timeout: timedelta | float | int) -> float:
    """Return ``timeout`` (timedelta or seconds) as float seconds; reject negatives."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise InvalidArgumentError(
            f"timeout must be a datetime.timedelta or seconds, got {type(timeout).__name__}"
        )
    if not seconds >= 0:  # also rejects NaN
        raise InvalidArgumentError(f"timeout must be zero or more seconds, got {seconds:g}")
    return seconds


def to_value(value) -> bytes:
    """Return a store value as bytes: bytes-like as is, str as UTF-8."""
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidArgumentError(
        f"store values must be bytes or str, got {type(value).__name__}; "
        f"encode it first (e.g. pickle.dumps or str(x).encode())"
    )


def check_key(key) -> str:
    """Return ``key`` if it is a str; raise InvalidArgumentError otherwise."""
    if not isinstance(key, str):
        raise InvalidArgumentError(f"store keys must be str, got {type(key).__name__} {key!r}")
    return key


def pair_up(keys: Sequence[str], values: Sequence) -> list[tuple[str, bytes]]:
    """Return ``[(key, value bytes), ...]`` for multi_set; reject unequal lengths."""
    if len(keys) != len(values):
        raise InvalidArgumentError(
            f"multi_set got {len(keys)} keys but {len(values)} values; pass one value per key"
        )
    return [(check_key(k), to_value(v)) for k, v in zip(keys, values, strict=True)]


def timeout_error(what: str, missing: Sequence[str], seconds: float) -> StoreTimeoutError:
    """Return the StoreTimeoutError for a ``what`` call still missing ``missing`` keys."""
    names = ", ".join(repr(k) for k in missing)
    return StoreTimeoutError(
        f"store {what}: Timed out after {seconds:g}s waiting for key(s) {names}; the rank that "
        f"sets them may have failed or not started yet: check its log, or pass a longer "
        f"timeout (init_process_group(timeout=...) or store.set_timeout)"
    )


def add_to(current: bytes | None, amount: int, key: str) -> bytes:
    """Return the new stored value of counter ``key`` after adding ``amount``.

    A missing key counts as 0; counters are stored as decimal ASCII (like torch).
    """
    if current is None:
        return str(amount).encode()
    try:
        return str(int(current) + amount).encode()
    except ValueError:
        raise InvalidArgumentError(
            f"store add({key!r}): the key holds {current[:40]!r}, not an integer counter; "
            f"use a separate key for counters"
        ) from None


def compare_set_result(current: bytes | None, expected: bytes,
                       desired: bytes) -> tuple[bytes | None, bytes]:
    """Apply torch's compare_set rule; return ``(value to store or None, value to return)``.

    The key is set to ``desired`` when it holds ``expected``, or when it is missing and
    ``expected`` is empty; then ``desired`` is returned.  Otherwise nothing changes and
    the current value is returned (``expected`` when the key is missing).
    """
    if (current is None and expected == b"") or current == expected:
        return desired, desired
    return None, expected if current is None else current


class Store(abc.ABC):
    """A key-value store shared by the ranks of a job (torch.distributed.Store API)."""

    def __init__(self, timeout: timedelta | float = DEFAULT_TIMEOUT):
        self._timeout = to_seconds(timeout)

    @property
    def timeout(self) -> timedelta:
        """The default timeout of ``get`` and ``wait``."""
        return timedelta(seconds=self._timeout)

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Set the default timeout of ``get`` and ``wait`` (timedelta or seconds)."""
        self._timeout = to_seconds(timeout)

    def _seconds(self, timeout: timedelta | float | None) -> float:
        return self._timeout if timeout is None else to_seconds(timeout)

    @abc.abstractmethod
    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key``, replacing any previous value."""

    @abc.abstractmethod
    def get(self, key: str, timeout: timedelta | float | None = None) -> bytes:
        """Return the value of ``key``, waiting for it to be set (StoreTimeoutError)."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer counter ``key`` (missing = 0); return the new value."""

    @abc.abstractmethod
    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (see ``compare_set_result``)."""

    @abc.abstractmethod
    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key in ``keys`` exists (StoreTimeoutError naming the missing)."""

    @abc.abstractmethod
    def check(self, keys: list[str]) -> bool:
        """Return True if every key in ``keys`` exists, without waiting."""

    @abc.abstractmethod
    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return True if it existed."""

    @abc.abstractmethod
    def num_keys(self) -> int:
        """Return the number of keys in the store."""

    def multi_get(self, keys: list[str], timeout: timedelta | float | None = None) -> list[bytes]:
        """Return the values of ``keys``, waiting until all exist."""
        self.wait(keys, timeout)
        return [self.get(k, timeout) for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Set each ``keys[i]`` to ``values[i]``."""
        for key, value in pair_up(keys, values):
            self.set(key, value)

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release what the store holds (sockets, server threads, files); idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
