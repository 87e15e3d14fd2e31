"""``Work`` (what ``async_op=True`` returns) and ``Future`` (what ``get_future()`` gives).

Same contract as torch.distributed's Work: ``wait(timeout=None)``, ``is_completed()``,
``is_success()``, ``exception()``, ``result()``, ``get_future()``.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from chorus.transport.base import Transport
from chorus.transport.handles import Handle


def seconds(timeout: timedelta | float | None) -> float | None:
    """A timeout given as timedelta or seconds, in seconds (None stays None)."""
    if timeout is None:
        return None
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class Future:
    """The result of an op, as torch.futures.Future offers it: ``wait()``, ``value()``,
    ``done()``, ``then(fn)``, ``add_done_callback(fn)``."""

    def __init__(self, inner: concurrent.futures.Future | None = None):
        self._f = inner if inner is not None else concurrent.futures.Future()

    def done(self) -> bool:
        """Whether the value (or an error) is there."""
        return self._f.done()

    def wait(self) -> Any:
        """Block until done; return the value or raise the error."""
        return self._f.result()

    def value(self) -> Any:
        """The value of a done Future (raises its error)."""
        return self._f.result()

    def set_result(self, value: Any) -> None:
        self._f.set_result(value)

    def set_exception(self, exc: BaseException) -> None:
        self._f.set_exception(exc)

    def add_done_callback(self, fn: Callable[[Future], None]) -> None:
        """Call ``fn(self)`` once done (at once if it already is)."""
        self._f.add_done_callback(lambda _: fn(self))

    def then(self, fn: Callable[[Future], Any]) -> Future:
        """A new Future holding ``fn(self)`` once this one is done."""
        nxt = Future()

        def chain(_: Any) -> None:
            try:
                nxt.set_result(fn(self))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                nxt.set_exception(exc)

        self._f.add_done_callback(chain)
        return nxt


class Work:
    """An op in flight: what a call with ``async_op=True`` (and ``isend``/``irecv``) returns.

    rank 0, 1: w = all_reduce(t, async_op=True); (other work); w.wait()   ->   t holds the sum

    Do not touch the op's tensors before ``wait()`` returns.  An op that failed raises its
    error from ``wait()`` (and ``result()``); ``exception()`` returns it without raising.
    """

    #: True where the op is queued on a device stream and ``wait()`` only orders the
    #: caller's current stream after it (CUDA); False where ``wait()`` blocks until done
    on_stream = False

    def __init__(self, result: list | None = None):
        self._result = result if result is not None else []
        self._error: BaseException | None = None
        self._finished = False
        self._future: Future | None = None

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Block until the op finished; raise its error.  Returns True like torch."""
        if not self._finished:
            limit = seconds(timeout)
            try:
                self._wait(None if limit is None else time.monotonic() + limit)
            except BaseException as exc:
                if isinstance(exc, TimeoutError) and limit is not None and not self._is_op_deadline(exc):
                    raise  # the caller's own timeout: the op may still finish later
                self._settle(exc)
                raise
            self._settle(None)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the op has finished (successfully or not), without blocking."""
        if not self._finished and self._poll():
            try:
                self.wait()
            except BaseException:  # noqa: BLE001 - kept in self._error
                pass
        return self._finished

    def is_success(self) -> bool:
        """Whether the op has finished without an error (False while it runs)."""
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        """The op's error if it finished with one, else None."""
        self.is_completed()
        return self._error

    def result(self) -> list:
        """Wait, then return the op's output tensors (as torch's ``Work.result()``)."""
        self.wait()
        return self._result

    def get_future(self) -> Future:
        """A :class:`Future` that completes with ``result()`` when the op does."""
        if self._future is None:
            self._future = Future()
            if self._finished:
                self._resolve_future()
            else:
                self._watch()
        return self._future

    # -- for subclasses --------------------------------------------------------------------
    def _wait(self, deadline: float | None) -> None:
        raise NotImplementedError

    def _poll(self) -> bool:
        raise NotImplementedError

    def _watch(self) -> None:
        """Arrange for ``_resolve_future`` to run when the op finishes."""
        raise NotImplementedError

    def _is_op_deadline(self, exc: BaseException) -> bool:
        return False

    def _settle(self, error: BaseException | None) -> None:
        if self._finished:
            return
        self._error = error
        self._finished = True
        if self._future is not None:
            self._resolve_future()

    def _resolve_future(self) -> None:
        if self._future.done():
            return
        if self._error is not None:
            self._future.set_exception(self._error)
        else:
            self._future.set_result(self._result)


class HandleWork(Work):
    """Work over transport handles (point-to-point): done when every handle is done.

    ``finish`` runs once, in the waiting thread, after success (copy-back of a
    non-contiguous buffer, translating the sender's rank, ...).
    """

    def __init__(self, transport: Transport, handles: list[Handle], deadline: float | None,
                 describe: Callable[[], str], finish: Callable[[], None] | None = None,
                 result: list | None = None, label: Callable[[], str] | None = None):
        super().__init__(result)
        self._transport = transport
        self._handles = handles
        self._deadline = deadline
        self._describe = describe
        self._finish = finish
        self._label = label  # names the op in waiting reports (chorus.transport.waiting)

    def _wait(self, deadline: float | None) -> None:
        own = deadline is None or (self._deadline is not None and self._deadline <= deadline)
        self._transport.wait_all(self._handles, self._deadline if own else deadline, self._describe,
                                 give_up=own, label=self._label)
        if self._finish is not None:
            self._finish()

    def _is_op_deadline(self, exc: BaseException) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _poll(self) -> bool:
        if all(h.done() for h in self._handles):
            return True
        self._transport.attend(self._handles)  # (a small receive waits for its waiter else)
        return False

    def _watch(self) -> None:
        self._transport.attend(self._handles)
        remaining = [len(self._handles)]

        def one_done(_: Handle) -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self.is_completed()

        if not self._handles:
            self.is_completed()
        for h in self._handles:
            h.add_done_callback(one_done)

    def source_rank(self) -> int | None:
        """The global rank a receive got its message from (any-source receives)."""
        self.wait()
        return self._handles[0].peer if self._handles else None


class QueuedWork(Work):
    """Work for an op that runs on the group's worker thread."""

    def __init__(self, future: concurrent.futures.Future, result: list | None = None):
        super().__init__(result)
        self._cf = future

    def _wait(self, deadline: float | None) -> None:
        try:
            self._cf.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise TimeoutError("Work.wait(timeout=...): Timed out before the op finished; "
                               "the op is still running") from None

    def _poll(self) -> bool:
        return self._cf.done()

    def _watch(self) -> None:
        self._cf.add_done_callback(lambda _: self.is_completed())


class CompletedWork(Work):
    """Work that is already finished (non-members, empty batches)."""

    def __init__(self, result: list | None = None):
        super().__init__(result)
        self._finished = True

    def _wait(self, deadline: float | None) -> None:
        return None

    def _poll(self) -> bool:
        return True

    def _watch(self) -> None:
        self._resolve_future()
