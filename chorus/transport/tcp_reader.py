"""Reading frames from a socket with as few system calls as possible.

Small frames often arrive together (a header and its payload, or several frames), so the
reader pulls whatever the kernel has into a buffer and serves headers and small payloads
from it.  A large payload is copied out of the buffer only for the part already there;
the rest is received straight into its destination.

A connection whose large payloads come through shared memory (chorus.transport.ring) also
sleeps here while such a payload is incomplete: :meth:`BufferedReader.doze` waits for the
socket, where the writer rings its bell (a HEARTBEAT frame) or its death shows as EOF.

A thread that waits for a small message reads the socket itself
(``chorus.transport.tcp_receive``) without blocking before a frame's header is complete:
it waits with :meth:`BufferedReader.readable`, takes what the kernel has with
:meth:`BufferedReader.fill_nowait`, and asks :meth:`BufferedReader.frame_buffered`
whether a header is here.
"""

from __future__ import annotations

import select
import socket

from chorus.wire.frames import HEADER_SIZE, Kind, control_header

BUFFER_BYTES = 256 * 1024
_NBYTES_AT = 28  # offset of the payload length (u64, little-endian) in a frame header
BELL = control_header(Kind.HEARTBEAT)  # a ring writer's doorbell is a plain heartbeat


class BufferedReader:
    def __init__(self, sock: socket.socket, size: int = BUFFER_BYTES):
        self._sock = sock
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._start = 0  # first unread byte
        self._end = 0  # one past the last received byte
        self._poller: select.poll | None = None  # the reading thread's
        self._watcher: select.poll | None = None  # the reader thread's, while it reads nothing
        self.received = 0  # bytes ever received: the heartbeat loop watches it grow mid-payload

    def _fill(self, need: int) -> None:
        """Make at least ``need`` (<= buffer size) unread bytes available."""
        if self._start + need > len(self._buf):  # not enough room behind: move the rest forward
            pending = self._end - self._start
            self._view[:pending] = self._view[self._start: self._end]
            self._start, self._end = 0, pending
        while self._end - self._start < need:
            got = self._sock.recv_into(self._view[self._end:])
            if not got:
                raise ConnectionError("connection closed by the peer (EOF)")
            self._end += got
            self.received += got

    def read(self, n: int) -> memoryview:
        """The next ``n`` bytes (n <= buffer size); valid until the next call."""
        self._fill(n)
        out = self._view[self._start: self._start + n]
        self._start += n
        return out

    def read_into(self, dst: memoryview) -> None:
        """Fill ``dst`` completely: buffered bytes first, then straight from the socket."""
        have = min(self._end - self._start, len(dst))
        if have:
            dst[:have] = self._view[self._start: self._start + have]
            self._start += have
        filled = have
        while filled < len(dst):
            got = self._sock.recv_into(dst[filled:])
            if not got:
                raise ConnectionError("connection closed by the peer (EOF) in the middle of a message")
            filled += got
            self.received += got
        if self._start == self._end:
            self._start = self._end = 0

    def take(self, header: bytes, dst: memoryview) -> int:
        """The next frame, if it is exactly ``header`` with a payload of ``len(dst)`` bytes:
        1 once all of it is buffered (its payload copied into ``dst``, the frame consumed);
        0 while what is buffered is the start of such a frame (or nothing); -1 if the next
        frame is another (nothing consumed)."""
        start, have = self._start, self._end - self._start
        if have < HEADER_SIZE:
            if not have:
                return 0
            return 0 if self._view[start: self._end] == header[:have] else -1
        if self._view[start: start + HEADER_SIZE] != header:
            return -1
        end = start + HEADER_SIZE + len(dst)
        if end > self._end:
            return 0
        dst[:] = self._view[start + HEADER_SIZE: end]
        if end == self._end:
            self._start = self._end = 0
        else:
            self._start = end
        return 1

    def buffered(self) -> int:
        """Bytes received and not read yet."""
        return self._end - self._start

    def frame_buffered(self) -> int:
        """The payload length of the next frame if its header is buffered, else -1.  The
        header is not checked here: whoever reads it does (``unpack_header``)."""
        if self._end - self._start < HEADER_SIZE:
            return -1
        at = self._start + _NBYTES_AT
        return int.from_bytes(self._view[at: at + 8], "little")

    def readable(self, seconds: float) -> bool:
        """(The thread reading) wait up to ``seconds`` for the socket to have bytes (or EOF,
        or an error)."""
        if self._poller is None:
            if self._sock.fileno() < 0:
                return True  # closed: reading says so
            self._poller = select.poll()
            self._poller.register(self._sock, select.POLLIN)
        return bool(self._poller.poll(seconds * 1e3))

    def watch(self) -> None:
        """(The reader thread, not reading) wait until the socket has bytes, EOF or an
        error.  A poll object of its own: two threads may not share one."""
        if self._watcher is None:
            if self._sock.fileno() < 0:
                return
            self._watcher = select.poll()
            self._watcher.register(self._sock, select.POLLIN)
        self._watcher.poll()

    def fill_nowait(self) -> int:
        """Buffer whatever the kernel has now, without blocking; the bytes got (0: none).
        Raises ConnectionError at EOF."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start and self._end == len(self._buf):
            pending = self._end - self._start
            self._view[:pending] = self._view[self._start: self._end]
            self._start, self._end = 0, pending
        if self._end == len(self._buf):
            return 0  # full: the frames buffered must be read first
        try:
            got = self._sock.recv_into(self._view[self._end:], 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        if not got:
            raise ConnectionError("connection closed by the peer (EOF)")
        self._end += got
        self.received += got
        return got

    def discard(self, n: int) -> None:
        """Skip ``n`` bytes (through the buffer: nothing is allocated, whatever ``n``)."""
        while n:
            chunk = min(n, len(self._buf))
            self.read(chunk)
            n -= chunk

    def doze(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for bytes on the socket and buffer them, dropping bells
        (HEARTBEAT frames) at the front; True if another frame is waiting.  Raises
        ConnectionError at EOF (the writer died)."""
        if self._skip_bells():
            return True
        if not self.readable(seconds):
            return False
        if self._end == len(self._buf):  # make room (less than a frame's header is buffered)
            pending = self._end - self._start
            self._view[:pending] = self._view[self._start: self._end]
            self._start, self._end = 0, pending
        got = self._sock.recv_into(self._view[self._end:])
        if not got:
            raise ConnectionError("connection closed by the peer (EOF) in the middle of a message "
                                  "coming through shared memory")
        self._end += got
        self.received += got
        return self._skip_bells()

    def _skip_bells(self) -> bool:
        n = len(BELL)
        while self._end - self._start >= n and self._view[self._start: self._start + n] == BELL:
            self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        return self._end - self._start >= n
