"""The store protocol: request and response frames, pure packing and parsing.

A client sends one request and reads one response (``TCPStore`` holds a lock around
each pair); the server answers a connection's requests in order.  Every frame is::

    length u32                      bytes that follow (the body)
    body:
      code   u8                     request: Op;  response: Status
      number i64                    request: timeout in ms (GET, WAIT, MULTI_GET) or the
                                    amount (ADD), else 0;  response: an integer result
                                    (ADD: new value; CHECK, DELETE_KEY: 0/1; NUM_KEYS)
      nargs  u32                    then nargs times:  length u32 | bytes
                                    (keys are UTF-8; values are opaque bytes)

Arguments per request: SET key value; GET key; ADD key; COMPARE_SET key expected
desired; WAIT/CHECK/MULTI_GET key...; DELETE_KEY key; NUM_KEYS none; MULTI_SET key
value key value...  Responses: OK with values (GET, COMPARE_SET, MULTI_GET); TIMEOUT
with the keys still missing and ``number`` = the timeout in ms; ERROR with a message.

All integers are big-endian.  A frame longer than ``max_frame`` or whose body does not
parse exactly raises ProtocolError; the server then drops that connection.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from chorus.errors import ProtocolError

MAX_FRAME = 1 << 30

_LENGTH = struct.Struct("!I")
_FIXED = struct.Struct("!BqI")


class Op(enum.IntEnum):
    """Request codes."""

    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    WAIT = 5
    CHECK = 6
    DELETE_KEY = 7
    NUM_KEYS = 8
    MULTI_GET = 9
    MULTI_SET = 10


class Status(enum.IntEnum):
    """Response codes."""

    OK = 0
    TIMEOUT = 1
    ERROR = 2


# (fewest args, most args or None for any, args must come in pairs)
_ARITY = {
    Op.SET: (2, 2, False), Op.GET: (1, 1, False), Op.ADD: (1, 1, False),
    Op.COMPARE_SET: (3, 3, False), Op.WAIT: (0, None, False), Op.CHECK: (0, None, False),
    Op.DELETE_KEY: (1, 1, False), Op.NUM_KEYS: (0, 0, False),
    Op.MULTI_GET: (0, None, False), Op.MULTI_SET: (0, None, True),
}
BLOCKING_OPS = frozenset({Op.GET, Op.WAIT, Op.MULTI_GET})


@dataclass(frozen=True)
class Request:
    """One store request: ``op``, its byte-string ``args`` and its integer ``number``."""

    op: Op
    args: tuple[bytes, ...] = ()
    number: int = 0


@dataclass(frozen=True)
class Response:
    """One store response: ``status``, byte-string ``args`` and integer ``number``."""

    status: Status
    args: tuple[bytes, ...] = ()
    number: int = 0


def _pack(code: int, number: int, args) -> bytes:
    parts = [b"", _FIXED.pack(code, number, len(args))]
    for arg in args:
        parts.append(_LENGTH.pack(len(arg)))
        parts.append(arg)
    size = sum(len(p) for p in parts)
    parts[0] = _LENGTH.pack(size)
    return b"".join(parts)


def _unpack(body) -> tuple[int, int, tuple[bytes, ...]]:
    """Split a body into ``(code, number, args)``; ProtocolError unless it parses exactly."""
    view = memoryview(body)
    if len(view) < _FIXED.size:
        raise ProtocolError(f"store frame of {len(view)} bytes is shorter than its fixed part")
    code, number, nargs = _FIXED.unpack_from(view)
    pos = _FIXED.size
    if nargs > (len(view) - pos) // _LENGTH.size:
        raise ProtocolError(f"store frame claims {nargs} arguments but has room for fewer")
    args = []
    for _ in range(nargs):
        (n,) = _LENGTH.unpack_from(view, pos)
        pos += _LENGTH.size
        if pos + n > len(view):
            raise ProtocolError("store frame argument runs past the end of the frame")
        args.append(bytes(view[pos:pos + n]))
        pos += n
    if pos != len(view):
        raise ProtocolError(f"store frame has {len(view) - pos} bytes after its last argument")
    return code, number, tuple(args)


def pack_request(request: Request) -> bytes:
    """Return the frame (length prefix included) for ``request``."""
    return _pack(request.op, request.number, request.args)


def parse_request(body) -> Request:
    """Parse a request body (without its length prefix); ProtocolError when invalid."""
    code, number, args = _unpack(body)
    try:
        op = Op(code)
    except ValueError:
        raise ProtocolError(f"unknown store op code {code}") from None
    low, high, pairs = _ARITY[op]
    if len(args) < low or (high is not None and len(args) > high) or (pairs and len(args) % 2):
        raise ProtocolError(f"store op {op.name} got {len(args)} arguments")
    if op in BLOCKING_OPS and number < 0:
        raise ProtocolError(f"store op {op.name} got a negative timeout ({number} ms)")
    return Request(op, args, number)


def pack_response(response: Response) -> bytes:
    """Return the frame (length prefix included) for ``response``."""
    return _pack(response.status, response.number, response.args)


def parse_response(body) -> Response:
    """Parse a response body (without its length prefix); ProtocolError when invalid."""
    code, number, args = _unpack(body)
    try:
        status = Status(code)
    except ValueError:
        raise ProtocolError(f"unknown store response status {code}") from None
    return Response(status, args, number)


def parse_length(prefix: bytes, max_frame: int = MAX_FRAME) -> int:
    """Return the body length announced by a 4-byte prefix; ProtocolError if too long."""
    (n,) = _LENGTH.unpack(bytes(prefix))
    if n > max_frame:
        raise ProtocolError(f"store frame of {n} bytes exceeds the limit of {max_frame}")
    return n


LENGTH_SIZE = _LENGTH.size


@dataclass(frozen=True)
class Refused:
    """In a parser's output, in place of a request: a frame of ``length`` bytes that was
    longer than the parser's ``refuse_over`` and was skipped unread (answer it with an
    error; the connection stays in step)."""

    length: int


class RequestParser:
    """Incremental request parser: ``feed(bytes)`` returns the requests completed so far.

    Raises ProtocolError on the first invalid frame (or one longer than ``max_frame``);
    the parser is then unusable.  A frame longer than ``refuse_over`` (when set) is not
    buffered: its bytes are dropped as they come and a :class:`Refused` takes its place.
    """

    def __init__(self, max_frame: int = MAX_FRAME, refuse_over: int | None = None):
        self._buf = bytearray()
        self._max_frame = max_frame
        self._skip = 0  # bytes of a refused frame still to drop
        self.refuse_over = refuse_over

    def feed(self, data: bytes) -> list[Request | Refused]:
        """Append ``data``; return every request whose frame is now complete."""
        if self._skip:
            dropped = min(self._skip, len(data))
            self._skip -= dropped
            data = data[dropped:]
        self._buf += data
        requests: list[Request | Refused] = []
        pos = 0
        while len(self._buf) - pos >= LENGTH_SIZE:
            n = parse_length(self._buf[pos:pos + LENGTH_SIZE], self._max_frame)
            if self.refuse_over is not None and n > self.refuse_over:
                requests.append(Refused(n))
                pos += LENGTH_SIZE
                dropped = min(n, len(self._buf) - pos)
                pos += dropped
                self._skip = n - dropped
                if self._skip:
                    break
                continue
            end = pos + LENGTH_SIZE + n
            if end > len(self._buf):
                break
            body = bytes(memoryview(self._buf)[pos + LENGTH_SIZE:end])
            requests.append(parse_request(body))
            pos = end
        if pos:
            del self._buf[:pos]
        return requests
