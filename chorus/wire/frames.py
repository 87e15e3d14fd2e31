"""Transport frame headers: pure packing and parsing, no sockets.

Every message between two ranks is one fixed-size header followed by ``nbytes`` of
payload.  The header says who the payload belongs to, so the receiver can write it
straight into the buffer that was posted for it::

    offset size field        meaning
    0      2    magic        b"CH"
    2      1    version      WIRE_VERSION
    3      1    kind         Kind (DATA, COLL, HEARTBEAT, ...)
    4      1    dtype        dtype code (chorus.wire.dtypes), 0 = raw bytes
    5      1    flags        reserved, 0
    6      2    reserved     0
    8      4    group        process-group id (0 = the world)
    12     8    tag          user tag (P2P) or step tag (collectives); control: a rank
    20     8    seq          the group's op sequence number (collectives)
    28     8    nbytes       payload length (0 .. 2**48)
    36     8    fingerprint  hash of the collective call (op, dtype, count, root, reduce op)

All integers are little-endian.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from chorus.errors import ProtocolError
from chorus.wire.dtypes import is_known_dtype_code

MAGIC = b"CH"
WIRE_VERSION = 2
MAX_PAYLOAD = 1 << 48

_HEADER = struct.Struct("<2sBBBBHIqQQQ")
HEADER_SIZE = _HEADER.size


class Kind(enum.IntEnum):
    """What a frame carries."""

    DATA = 1  # point-to-point payload (send/recv)
    COLL = 2  # collective payload
    HEARTBEAT = 3  # liveness only; no payload
    PEER_LOST = 4  # tag = the global rank this sender lost, seq = a LostReason
    BYE = 5  # the sender is leaving cleanly (destroy_process_group)
    HELLO = 6  # first frame on a transport connection: tag = sender rank, group = world size
    ABORT = 7  # collective mismatch in `group`: tag = the rank whose call differed and the
    #            rank that found it (abort_tag), seq and fingerprint = the first one's call
    FAILED = 8  # tag = a rank that failed (raised); payload = its error as UTF-8 text,
    #             "ValueError: ..." (at most MAX_FAILURE_TEXT bytes)
    MATCHED = 9  # a receive took the rendezvous send numbered `seq` (group, tag: the send's)
    PROBE = 10  # deadlock search (chorus.transport.rendezvous_sends): payload = the hops so far
    #             (chorus.wire.probes); seq 1 = the hops close a cycle


_KINDS = frozenset(int(k) for k in Kind)

#: The longest error text a FAILED frame carries (longer ones are cut).
MAX_FAILURE_TEXT = 2048

#: The largest PROBE payload (chorus.wire.probes: 2,340 hops; longer cycles are not searched).
MAX_PROBE_BYTES = 64 * 1024


class LostReason(enum.IntEnum):
    """Why a rank was given up on (carried in a PEER_LOST frame's ``seq``)."""

    DIED = 1  # its connection broke (EOF, reset): the process is gone
    SILENT = 2  # no frame, not even a heartbeat, within the heartbeat timeout
    INVALID = 3  # it sent bytes that are not valid frames
    UNREADABLE = 4  # the reporter's reader of its connection failed (it is cut off all the same)


LOST_REASON_TEXT = {
    LostReason.DIED: "died",
    LostReason.SILENT: "stopped answering (no heartbeat)",
    LostReason.INVALID: "sent invalid frames and was disconnected",
    LostReason.UNREADABLE: "could not be read from any more and was disconnected",
}


@dataclass(frozen=True, slots=True)
class Header:
    kind: int
    group: int
    tag: int
    seq: int = 0
    nbytes: int = 0
    dtype: int = 0
    fingerprint: int = 0


def pack_header(h: Header) -> bytes:
    """Return the HEADER_SIZE bytes for ``h``."""
    return _HEADER.pack(
        MAGIC, WIRE_VERSION, h.kind, h.dtype, 0, 0, h.group, h.tag, h.seq, h.nbytes, h.fingerprint
    )


def abort_tag(culprit: int, detector: int) -> int:
    """An ABORT frame's tag: the rank whose call differed (low 32 bits) and the rank that
    found it, plus one (the 31 bits above: ranks below 2**31 - 1), so that a notice passed
    on still names who found it."""
    return culprit | (detector + 1) << 32


def abort_parties(tag: int, sender: int) -> tuple[int, int]:
    """(culprit, detector) of an ABORT frame's ``tag`` from ``sender`` (the detector when
    the tag names none)."""
    found = tag >> 32
    return tag & 0xFFFFFFFF, found - 1 if found else sender


def pack_fields(kind: int, group: int, tag: int, seq: int, nbytes: int, dtype: int, fp: int) -> bytes:
    """Like :func:`pack_header` without building a Header first (the hot path)."""
    return _HEADER.pack(MAGIC, WIRE_VERSION, kind, dtype, 0, 0, group, tag, seq, nbytes, fp)


def control_header(kind: Kind, tag: int = 0, group: int = 0) -> bytes:
    """Header bytes of a payload-less control frame (HEARTBEAT, PEER_LOST, BYE, HELLO)."""
    return pack_fields(int(kind), group, tag, 0, 0, 0, 0)


def unpack_header(data: bytes | bytearray | memoryview) -> Header:
    """Parse a header; raise ProtocolError for anything that is not a valid frame."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"frame header must be {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, kind, dtype, flags, reserved, group, tag, seq, nbytes, fp = _HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): not a chorus peer")
    if version != WIRE_VERSION:
        raise ProtocolError(
            f"peer speaks chorus wire version {version}, this rank speaks {WIRE_VERSION}: "
            "run the same chorus version on every rank"
        )
    if kind not in _KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    if flags or reserved:
        raise ProtocolError(f"reserved header bits set (flags={flags}, reserved={reserved})")
    if not is_known_dtype_code(dtype):
        raise ProtocolError(f"unknown dtype code {dtype} in frame header")
    if nbytes > MAX_PAYLOAD:
        raise ProtocolError(f"frame payload of {nbytes} bytes exceeds the limit of {MAX_PAYLOAD}")
    if kind in (Kind.HEARTBEAT, Kind.PEER_LOST, Kind.BYE, Kind.HELLO, Kind.ABORT, Kind.MATCHED) and nbytes:
        raise ProtocolError(f"control frame {Kind(kind).name} must carry no payload")
    if kind == Kind.FAILED and nbytes > MAX_FAILURE_TEXT:
        raise ProtocolError(f"FAILED frame of {nbytes} bytes exceeds the limit of {MAX_FAILURE_TEXT}")
    if kind == Kind.PROBE and nbytes > MAX_PROBE_BYTES:
        raise ProtocolError(f"PROBE frame of {nbytes} bytes exceeds the limit of {MAX_PROBE_BYTES}")
    return Header(kind, group, tag, seq, nbytes, dtype, fp)


def pack_failed(rank: int, text: str) -> bytes:
    """A FAILED frame, header and payload: ``rank`` failed with ``text`` (cut to fit)."""
    payload = text.encode("utf-8", "replace")[:MAX_FAILURE_TEXT]
    return pack_fields(int(Kind.FAILED), 0, rank, 0, len(payload), 0, 0) + payload


def failed_text(payload: bytes | memoryview) -> str:
    """The error text of a FAILED frame's payload (a cut multi-byte character is replaced)."""
    return bytes(payload).decode("utf-8", "replace")
