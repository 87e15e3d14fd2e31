"""Handles for posted transfers, and waiting on several of them with one deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from chorus.errors import CommTimeoutError
from chorus.wire.frames import Header


class Handle:
    """One posted send or receive.  Completed exactly once, by whichever thread finishes it.

    ``peer`` is the global rank (None for an any-source receive until it matched);
    after completion ``header`` holds the frame header that was sent or received.
    """

    __slots__ = ("peer", "kind", "group", "tag", "view", "dtype", "expect", "finish", "receive", "header",
                 "error", "_signal", "_done", "_callbacks")

    def __init__(self, peer: int | None, kind: int, group: int, tag: int,
                 view: memoryview | None = None, dtype: int = 0,
                 expect: tuple[int, int] | None = None,
                 finish: Callable[[], None] | None = None):
        self.peer = peer
        self.kind = kind
        self.group = group
        self.tag = tag
        self.view = view
        self.dtype = dtype
        self.expect = expect  # (seq, fingerprint) a collective receive must see
        # Runs in the completing thread after the data landed and before waiters wake
        # (a reducing receive combines its temporary into the destination here).
        self.finish = finish
        self.receive = False  # a receive (set by Transport.irecv), not a send
        self.header: Header | None = None
        self.error: BaseException | None = None
        # Held until completion: wait() acquires it (a bare lock wakes a waiter faster than
        # threading.Event, whose Condition costs extra Python-level locking).
        self._signal = threading.Lock()
        self._signal.acquire()
        self._done = False
        self._callbacks: list[Callable[[Handle], None]] | None = None

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.kind, self.group, self.tag)

    def done(self) -> bool:
        return self._done

    def complete(self, header: Header | None = None, error: BaseException | None = None) -> None:
        """Mark finished (first call wins); wake waiters and run callbacks."""
        if self._done:
            return
        if error is None and self.finish is not None:
            try:
                self.finish()
            except Exception as exc:  # noqa: BLE001 - reported to the waiter
                error = exc
        self.header = header
        self.error = error
        self._done = True
        self._signal.release()
        if self._callbacks:
            for cb in self._callbacks:
                cb(self)

    def add_done_callback(self, cb: Callable[[Handle], None]) -> None:
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(cb)
        if self._done:
            cb(self)

    def wait(self, deadline: float | None) -> bool:
        """Block until done or until ``deadline`` (time.monotonic()); True if done."""
        if self._done:
            return True
        timeout = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if self._signal.acquire(timeout=timeout):
            self._signal.release()  # let other waiters through too
            return True
        return self._done


def wait_all(handles: Iterable[Handle], deadline: float | None, what: Callable[[], str],
             watcher=None, label: Callable[[], str] | None = None) -> None:
    """Wait for every handle; raise the first error, or CommTimeoutError at the deadline.

    ``what()`` describes the op for the timeout message ("barrier (seq 3) on group 0").
    The message names the peers whose transfers never finished.  A handle that is not done
    yet is first moved on by ``watcher.progress`` (the transport: TCP reads a small
    receive's socket in this thread), then waited for through ``watcher.wait_long``
    (waiting reports named by ``label()``, default ``what()``, and deadlock searches);
    handles that are done cost nothing more.
    """
    handles = list(handles)
    for h in handles:
        if not h._done and watcher is not None:
            watcher.progress(h, handles, deadline)
            if not h._done:
                watcher.wait_long(h, handles, deadline, label or what)
        if not h.wait(deadline):
            pending = sorted({p.peer for p in handles if not p.done() and p.peer is not None})
            anysrc = any(p.peer is None and not p.done() for p in handles)
            who = f"ranks {pending}" if pending else "any rank"
            if anysrc and pending:
                who += " and any-source receives"
            raise CommTimeoutError(
                f"{what()}: Timed out waiting for the op's transfers: no answer from {who}. Check that "
                "every rank of the group calls the same ops in the same order; raise timeout= if the "
                "peers are just slow."
            )
        if h.error is not None:
            raise h.error
