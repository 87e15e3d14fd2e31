"""``FileStore``: a store in a file, shared by processes that see the same file system.

The file is an append-only log of records, written under an exclusive ``flock`` and
read under a shared one::

    kind u8 | key length u32 | value length u32 | key (UTF-8) | value      (big-endian)

    kind 1 SET key=value     2 DELETE key     3 LEAVE (an instance closed)

Each instance replays the records it has not seen yet into a dict before every
operation, so reads are local once caught up.  ``get``/``wait`` poll the file's size
with a back-off from 1 ms to 50 ms.  With ``world_size > 0`` the file is deleted when
that many instances have closed (torch's rule); start every job with a fresh path, as
records left by an earlier job would still be visible.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
from datetime import timedelta

from chorus.errors import ChorusError, ProtocolError
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

_RECORD = struct.Struct("!BII")
_SET, _DELETE, _LEAVE = 1, 2, 3
_MIN_POLL, _MAX_POLL = 0.001, 0.05


def _record(kind: int, key: str = "", value: bytes = b"") -> bytes:
    raw = key.encode("utf-8")
    return _RECORD.pack(kind, len(raw), len(value)) + raw + value


class FileStore(Store):
    """A store kept in ``file_name``; ``world_size`` instances delete it when all close."""

    def __init__(self, file_name: str, world_size: int = -1,
                 timeout: timedelta | float = DEFAULT_TIMEOUT):
        super().__init__(timeout)
        self.path = os.fspath(file_name)
        self.world_size = world_size
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._lock = threading.Lock()  # flock does not exclude threads sharing one fd
        self._data: dict[str, bytes] = {}
        self._offset = 0
        self._leaves = 0

    # -- the log ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, exclusive: bool):
        """Hold the thread lock and the file lock, caught up with the log."""
        with self._lock:
            if self._fd is None:
                raise ChorusError(f"FileStore({self.path!r}) is closed")
            fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                self._catch_up()
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _catch_up(self) -> None:
        """Apply the records appended since the last call (lock held)."""
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        data = os.pread(self._fd, size - self._offset, self._offset)
        pos = 0
        while pos + _RECORD.size <= len(data):
            kind, klen, vlen = _RECORD.unpack_from(data, pos)
            end = pos + _RECORD.size + klen + vlen
            if end > len(data):
                break
            key = data[pos + _RECORD.size:pos + _RECORD.size + klen].decode("utf-8")
            if kind == _SET:
                self._data[key] = data[end - vlen:end]
            elif kind == _DELETE:
                self._data.pop(key, None)
            elif kind == _LEAVE:
                self._leaves += 1
            else:
                raise ProtocolError(
                    f"FileStore {self.path!r} holds an unknown record kind {kind} at offset "
                    f"{self._offset + pos}; the file is not a chorus store (use a fresh path)"
                )
            pos = end
        self._offset += pos

    def _append(self, *records: bytes) -> None:
        """Append records and apply them locally (exclusive lock held)."""
        blob = b"".join(records)
        os.lseek(self._fd, 0, os.SEEK_END)
        written = 0
        while written < len(blob):
            written += os.write(self._fd, blob[written:])
        self._catch_up()

    def _wait_for(self, what: str, keys: list[str], timeout) -> dict[str, bytes]:
        """Poll until every key exists; return a snapshot of the data."""
        seconds = self._seconds(timeout)
        deadline = time.monotonic() + seconds
        delay = _MIN_POLL
        while True:
            with self._locked(exclusive=False):
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return dict(self._data)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise timeout_error(what, missing, seconds)
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_POLL)

    # -- the Store API ---------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key``."""
        record = _record(_SET, check_key(key), to_value(value))
        with self._locked(exclusive=True):
            self._append(record)

    def get(self, key: str, timeout: timedelta | float | None = None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` for it."""
        return self._wait_for("get", [check_key(key)], timeout)[key]

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to counter ``key``; return the new value."""
        check_key(key)
        with self._locked(exclusive=True):
            value = add_to(self._data.get(key), int(amount), key)
            self._append(_record(_SET, key, value))
            return int(value)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return the resulting value."""
        check_key(key)
        with self._locked(exclusive=True):
            new, result = compare_set_result(self._data.get(key), to_value(expected),
                                             to_value(desired))
            if new is not None:
                self._append(_record(_SET, key, new))
            return result

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key exists (StoreTimeoutError after ``timeout``)."""
        self._wait_for("wait", [check_key(k) for k in keys], timeout)

    def check(self, keys: list[str]) -> bool:
        """Return True if every key exists."""
        keys = [check_key(k) for k in keys]
        with self._locked(exclusive=False):
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return True if it existed."""
        check_key(key)
        with self._locked(exclusive=True):
            if key not in self._data:
                return False
            self._append(_record(_DELETE, key))
            return True

    def num_keys(self) -> int:
        """Return the number of keys."""
        with self._locked(exclusive=False):
            return len(self._data)

    def multi_get(self, keys: list[str], timeout: timedelta | float | None = None) -> list[bytes]:
        """Return the values of ``keys`` (read together), waiting until all exist."""
        keys = [check_key(k) for k in keys]
        snapshot = self._wait_for("multi_get", keys, timeout)
        return [snapshot[k] for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Set every ``keys[i]`` to ``values[i]`` in one append."""
        records = [_record(_SET, k, v) for k, v in pair_up(keys, values)]
        with self._locked(exclusive=True):
            self._append(*records)

    def close(self) -> None:
        """Record that this instance left; delete the file once ``world_size`` have left."""
        with self._lock:
            if self._fd is None:
                return
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                self._catch_up()
                self._append(_record(_LEAVE))
                if 0 < self.world_size <= self._leaves:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)
            finally:
                os.close(self._fd)  # also drops the flock
                self._fd = None
