"""The payload of a PROBE frame: the hops of a deadlock search, pure packing and parsing.

Each hop is one rank waiting in a rendezvous send (chorus.transport.rendezvous_sends)::

    offset size field    meaning
    0      4    rank     the waiting rank (global)
    4      4    peer     the rank its send goes to (global)
    8      8    tag      the send's tag
    16     4    group    the send's group id
    20     8    request  the send's request number (the seq of its DATA frame)

A payload is a whole number of hops, at most MAX_PROBE_BYTES; little-endian.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from chorus.errors import ProtocolError
from chorus.wire.frames import MAX_PROBE_BYTES

_HOP = struct.Struct("<iiqIQ")
HOP_SIZE = _HOP.size
MAX_HOPS = MAX_PROBE_BYTES // HOP_SIZE


class Hop(NamedTuple):
    rank: int
    peer: int
    tag: int
    group: int
    request: int


def pack_hops(hops: list[Hop]) -> bytes:
    """The payload for ``hops`` (at most MAX_HOPS)."""
    if len(hops) > MAX_HOPS:
        raise ValueError(f"a probe holds at most {MAX_HOPS} hops, not {len(hops)}")
    return b"".join(_HOP.pack(*hop) for hop in hops)


def unpack_hops(payload: bytes | memoryview) -> list[Hop]:
    """The hops of a PROBE payload; ProtocolError if it is not a whole number of hops."""
    if not payload or len(payload) % HOP_SIZE or len(payload) > MAX_PROBE_BYTES:
        raise ProtocolError(f"a PROBE payload of {len(payload)} bytes is not 1 to {MAX_HOPS} "
                            f"hops of {HOP_SIZE} bytes")
    return [Hop(*fields) for fields in _HOP.iter_unpack(payload)]
