"""Matching arrivals to posted receives (the MPI "posted / unexpected" queues).

A message is identified by its key ``(kind, group, tag)`` and its source rank.  Messages
from one source with one key match receives in the order both were issued.

* A receive posted before its message arrives waits in ``posted``; the transport then
  writes the payload straight into the receive's buffer.
* A message that arrives first is stashed in ``unexpected`` (its payload copied into a
  temporary buffer, possibly still being read from the socket) until a receive claims it.

Both transports (loopback and tcp) use this class; it does no I/O itself.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from chorus.transport.handles import Handle
from chorus.wire.frames import Header

Key = tuple[int, int, int]


class Arrival:
    """A message that arrived before its receive was posted."""

    __slots__ = ("peer", "header", "data", "ready", "claimant")

    def __init__(self, peer: int, header: Header):
        self.peer = peer
        self.header = header
        self.data: memoryview | None = None
        self.ready = False
        self.claimant: Handle | None = None


class Matcher:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._posted_cv = threading.Condition(self._lock)
        self._posted: dict[Key, deque[Handle]] = {}
        self._unexpected: dict[Key, deque[Arrival]] = {}
        self._claimed: set[Arrival] = set()  # claimed while their payload is still being read
        # Receives that a reading thread fills itself, from the next frame of their key on
        # their peer's connection (TcpReceiving.recv_now): not matched here, but failed by
        # fail_where and seen by find_posted like posted ones.
        self._held: set[Handle] = set()
        self._graced = 0  # readers waiting (``claim``'s grace) for a receive to be posted

    # -- receiver side: a receive is posted ---------------------------------------------
    def post(self, handle: Handle) -> Arrival | None:
        """Register ``handle``; return an already-complete Arrival for it to copy, if any.

        If the matching message is still being read, the reader completes the handle
        (see :meth:`arrival_ready`) and this returns None.
        """
        with self._lock:
            queue = self._unexpected.get(handle.key)
            if queue:
                for arrival in queue:
                    if handle.peer is None or handle.peer == arrival.peer:
                        queue.remove(arrival)
                        if not queue:
                            del self._unexpected[handle.key]
                        if arrival.ready:
                            return arrival
                        arrival.claimant = handle
                        self._claimed.add(arrival)
                        return None
            self._posted.setdefault(handle.key, deque()).append(handle)
            if self._graced:  # Condition.notify_all costs microseconds even with no waiter
                self._posted_cv.notify_all()
            return None

    def hold(self, handle: Handle) -> None:
        """Hold ``handle``, a receive that the thread reading its peer's connection fills."""
        with self._lock:
            self._held.add(handle)

    def unhold(self, handle: Handle) -> bool:
        """Stop holding ``handle``: True, or False if a failure sweep took it already."""
        with self._lock:
            if handle in self._held:
                self._held.remove(handle)
                return True
            return False

    # -- reader side: a frame header arrived ---------------------------------------------
    def claim(self, peer: int, header: Header, wait: float = 0.0) -> Handle | Arrival:
        """Return the posted receive for this message, or a new stashed Arrival.

        With ``wait`` > 0, first wait up to that many seconds for the receive to be
        posted (large messages: a short wait saves a copy of the whole payload).
        """
        key = (header.kind, header.group, header.tag)
        with self._lock:
            handle = self._take_posted(peer, key)
            if handle is None and wait > 0:
                self._graced += 1
                try:
                    self._posted_cv.wait_for(lambda: self._has_posted(peer, key), timeout=wait)
                finally:
                    self._graced -= 1
                handle = self._take_posted(peer, key)
            if handle is not None:
                return handle
            arrival = Arrival(peer, header)
            self._unexpected.setdefault(key, deque()).append(arrival)
            return arrival

    def arrival_ready(self, arrival: Arrival, data: memoryview) -> Handle | None:
        """The stashed payload is fully read; return the receive that already claimed it."""
        with self._lock:
            arrival.data = data
            arrival.ready = True
            self._claimed.discard(arrival)
            return arrival.claimant

    # -- failures ------------------------------------------------------------------------
    def fail_where(self, pred: Callable[[Handle], bool], error_for: Callable[[Handle], BaseException]) -> None:
        """Complete every posted receive for which ``pred`` holds with ``error_for(h)``."""
        failed: list[Handle] = []
        with self._lock:
            for key in list(self._posted):
                queue = self._posted[key]
                keep = deque(h for h in queue if not pred(h))
                failed.extend(h for h in queue if pred(h))
                if keep:
                    self._posted[key] = keep
                else:
                    del self._posted[key]
            for h in [h for h in self._held if pred(h)]:
                self._held.remove(h)
                failed.append(h)
            for arrival in list(self._claimed):
                if arrival.claimant is not None and pred(arrival.claimant):
                    failed.append(arrival.claimant)
                    arrival.claimant = None
                    self._claimed.discard(arrival)
        for h in failed:
            h.complete(error=error_for(h))

    def find_posted(self, pred: Callable[[Handle], bool]) -> Handle | None:
        """Some posted (or held) receive for which ``pred`` holds (for consistency checks)."""
        with self._lock:
            for queue in self._posted.values():
                for h in queue:
                    if pred(h):
                        return h
            for h in self._held:
                if pred(h):
                    return h
        return None

    def find_unexpected(self, pred: Callable[[Arrival], bool]) -> Arrival | None:
        """Some stashed message for which ``pred`` holds (for consistency checks)."""
        with self._lock:
            for queue in self._unexpected.values():
                for a in queue:
                    if pred(a):
                        return a
        return None

    def discard_where(self, pred: Callable[[Arrival], bool]) -> None:
        """Drop the stashed messages for which ``pred`` holds that no receive claimed (an
        abandoned op's, which no receive will take: Transport.abandon)."""
        with self._lock:
            for key in list(self._unexpected):
                kept = deque(a for a in self._unexpected[key] if a.claimant is not None or not pred(a))
                if kept:
                    self._unexpected[key] = kept
                else:
                    del self._unexpected[key]

    def stashes(self) -> bool:
        """Whether any message is stashed (read without the lock: a frame stashed while a
        caller acts on False is checked against the receives posted by then, ``Transport.stashed``)."""
        return bool(self._unexpected)

    def awaits(self, peer: int) -> bool:
        """Whether a posted receive can be completed by a message from ``peer``."""
        if not self._posted:  # (the common case after a receive completed: no lock)
            return False
        with self._lock:
            return any(h.peer is None or h.peer == peer for queue in self._posted.values() for h in queue)

    def cancel(self, handle: Handle) -> None:
        """Withdraw a posted receive that nobody waits for any more (after a timeout)."""
        with self._lock:
            queue = self._posted.get(handle.key)
            if queue and handle in queue:
                queue.remove(handle)

    # -- internals -----------------------------------------------------------------------
    def _take_posted(self, peer: int, key: Key) -> Handle | None:
        queue = self._posted.get(key)
        if not queue:
            return None
        for handle in queue:
            if handle.peer is None or handle.peer == peer:
                queue.remove(handle)
                if not queue:
                    del self._posted[key]
                return handle
        return None

    def _has_posted(self, peer: int, key: Key) -> bool:
        queue = self._posted.get(key)
        return bool(queue) and any(h.peer is None or h.peer == peer for h in queue)
