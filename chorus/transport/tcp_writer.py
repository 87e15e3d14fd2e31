"""Writing to a peer's socket in bounded slices.

A blocking ``sendall`` to a peer that stops reading (a stopped process, a partitioned
host) sits until the kernel gives up, minutes later.  Instead every connection's socket
stays blocking (no extra system call per message: a small frame is one ``send``) but
carries a kernel send timeout (``SO_SNDTIMEO``) of ``SEND_SLICE_S``: a ``send`` that finds
no room returns after at most one slice, with what it wrote.  Between slices the writer
asks whether the peer is gone (``gone()``, a reason or None) and whether it should stop
for now (``until``), so a write never outlives the peer's loss, and a caller that must
keep its op's deadline can hand the rest of its frame to the connection's sender thread.
A lost peer's socket is also shut down, which ends a slice at once.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

SEND_SLICE_S = 0.1


def bound_sends(sock: socket.socket, seconds: float = SEND_SLICE_S) -> None:
    """Make every blocking ``send`` on ``sock`` return within ``seconds`` (SO_SNDTIMEO)."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", whole, int((seconds - whole) * 1e6)))


def send_some(sock: socket.socket, data, until: float | None, gone: Callable[[], str | None]) -> int:
    """Write ``data`` (bytes or a memoryview); return how many bytes went out: all of
    them, or fewer once ``until`` (time.monotonic(); None: no limit) has passed at the
    end of a slice.  Raises ConnectionError when ``gone()`` says the peer is lost."""
    try:
        sent = sock.send(data)
    except BlockingIOError:  # a whole slice without room: the peer reads nothing
        sent = 0
    return sent if sent == len(data) else send_rest(sock, data, sent, until, gone)


def send_rest(sock: socket.socket, data, sent: int, until: float | None, gone: Callable[[], str | None]) -> int:
    """``send_some`` after its first ``send`` wrote ``sent`` bytes of ``data``, fewer than all."""
    n = len(data)
    view = memoryview(data).cast("B")
    while sent < n:
        why = gone()
        if why is not None:
            raise ConnectionError(f"stopped writing: the peer {why}")
        if until is not None and time.monotonic() >= until:
            return sent
        try:
            sent += sock.send(view[sent:])
        except BlockingIOError:
            pass
    return sent
