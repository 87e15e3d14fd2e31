"""The shared-memory side of a TCP connection between two ranks of one host.

Two ranks on one host still get their TCP connection (control frames, failure
detection, order), plus one segment holding two byte rings (chorus.transport.ring), one per
direction.  A frame whose payload has at least ``min_bytes`` sends its header over the
socket as always and its payload through the ring; smaller payloads ride the socket.
The reader learns where a payload is from its header alone (both ends agreed on
``min_bytes`` here), so frames stay in the socket's order whatever path their bytes take::

    socket  | H1 + payload | H2 |      | H3 + payload | ...      H2's payload >= min_bytes
    ring                   | H2's payload, streamed in pieces |

Set-up, on the raw socket right after the HELLO (before the reader thread starts)::

    connector (higher rank)                 acceptor (lower rank)
    --- want: host digest, ring bytes --->
                                            same host digest, both want rings?
                                              create the segment, write a nonce
    <-- offer: size, ring bytes, min_bytes,
        nonce, path (size 0: no rings) ---
    map it, check the nonce
    --- ack (1: mapped, 0: failed) ------->
                                            UNLINK: both mapped it (or gave up)

The segment's name is gone as soon as it is created: the connector maps it through the
acceptor's descriptor (``chorus.host.segment``), which the acceptor closes at UNLINK.
The rings exist only as the two processes' mappings and vanish with them, ``kill -9``
at any moment included.  (Only an acceptor killed in the microseconds between the
``open`` that creates the file and its ``unlink`` leaves a file, named
``chorus-<CHORUS_JOB_ID>-gp<lo>.<hi>-...`` so that ``chorus.shm.sweep(job_id)``, which
chorusrun runs, and the next segment created on the host remove it.)  Segment layout::

    0              4 KiB               magic, ring bytes, nonce (checked at attach)
    4 KiB          4 KiB + R           ring 0: connector -> acceptor
    8 KiB + R      4 KiB + R           ring 1: acceptor -> connector

Settings (read when the connection is made): ``CHORUS_SHM_P2P=0`` turns rings off (so
does ``CHORUS_TRANSPORT=tcp``, and a CPU other than x86 unless ``CHORUS_TRANSPORT=shm``);
``CHORUS_SHM_P2P_BYTES`` is R (default 4 MiB, less for large worlds so that one rank maps
at most 32 MiB of rings; worlds that would need less than 256 KiB per ring get none);
``CHORUS_SHM_P2P_MIN`` is ``min_bytes`` (default 256 KiB).  A segment is made only
if ``CHORUS_SHM_BYTES`` (64 MiB) stay free in /dev/shm after it: the collectives'
windows come first; a pair without rings uses the socket (one warning per process).

Measured (2-core AMD EPYC VM, W = 2, both paths timed alternately in one process pair):
through the ring, 4-16 KiB messages were 15-25% slower than loopback TCP (the ring's
Python per message), 64-128 KiB even (0.93-1.23x), 256 KiB-64 MiB 1.1-1.9x faster
(medians; at 64 MiB exchange 1.3-1.5x, ping-pong 0.9-1.3x).  Hence ``min_bytes``, and
rings on by default.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable

from chorus import config
from chorus.host.identity import NO_HOST, host_digest, platform_ok, transport_mode
from chorus.host.segment import SHM_DIR, Segment
from chorus.net import recv_exact
from chorus.transport.ring import RingReader, RingWriter, ring_size

log = logging.getLogger("chorus")

DEFAULT_RING = 4 << 20
MIN_RING = 256 << 10
RANK_BUDGET = 32 << 20  # ring bytes one rank maps, in and out, over all its peers
DEFAULT_MIN_BYTES = 256 << 10
# Copy granularity: a 64 MiB message streams as 128 pieces, the reader's copy of one
# overlapping the writer's copy of the next (128 KiB-1 MiB measured alike; >= 4 per ring).
PIECE = 512 << 10
# How long a waiting end polls (yielding the CPU between polls) before it sleeps: about
# one piece's copy time (0 and 1 ms measured no better on a 2-core host).
YIELD_S = 100e-6
MAGIC = b"CHRING01"
HEADER = 4096
_SEG = struct.Struct("<8sQ16s")  # magic, ring bytes, nonce
_WANT = struct.Struct("<32sQ")  # host digest, ring bytes wanted (0: none)
_OFFER = struct.Struct("<QQQ16s256s")  # segment bytes (0: none), ring bytes, min bytes, nonce, path


def enabled() -> bool:
    """Whether this rank offers rings: ``CHORUS_SHM_P2P`` (default on) and CHORUS_TRANSPORT."""
    if not config.get("CHORUS_SHM_P2P"):
        return False
    mode = transport_mode()
    return mode == "shm" or (mode == "auto" and platform_ok())


def wanted_ring_bytes(world_size: int) -> int:
    """R for this rank (0: no rings): ``CHORUS_SHM_P2P_BYTES``, else 4 MiB within budget."""
    explicit = config.get("CHORUS_SHM_P2P_BYTES")
    if explicit:
        return max(4096, explicit // 4096 * 4096)
    ring = min(DEFAULT_RING, RANK_BUDGET // (2 * max(1, world_size - 1)) // 4096 * 4096)
    return ring if ring >= MIN_RING else 0


def _check_room(size: int) -> None:
    """Refuse (OSError) to take space a collectives' window may need: a ring segment is
    made only if ``CHORUS_SHM_BYTES`` (64 MiB) stay free in /dev/shm after it (Docker's
    default /dev/shm is 64 MiB: there, collectives keep it and point-to-point uses TCP)."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    keep = config.get("CHORUS_SHM_BYTES")
    if free < size + keep:
        raise OSError(f"{SHM_DIR} has {free >> 20} MiB free; rings need {size >> 20} MiB and "
                      f"{keep >> 20} MiB are kept for collectives (CHORUS_SHM_BYTES). Enlarge "
                      f"{SHM_DIR} (docker run --shm-size=...) or set CHORUS_SHM_P2P_BYTES lower")


_warned = threading.Event()


def _warn_once(message: str) -> None:
    """Log the first failure to set up rings as a warning, later ones at debug level."""
    (log.debug if _warned.is_set() else log.warning)(message)
    _warned.set()


class Pairing:
    """What both ends agreed on: the mapped segment, R, ``min_bytes``, and which ring this
    end writes (0: the connector's, 1: the acceptor's)."""

    def __init__(self, segment: Segment, ring_bytes: int, min_bytes: int, out_index: int):
        self.segment = segment
        self.ring_bytes = ring_bytes
        self.min_bytes = min_bytes
        self.out_index = out_index

    def _offset(self, index: int) -> int:
        return HEADER + index * ring_size(self.ring_bytes)

    def writer(self, **waiting) -> RingWriter:
        return RingWriter(self.segment.buf, self._offset(self.out_index), self.ring_bytes, **waiting)

    def reader(self, **waiting) -> RingReader:
        return RingReader(self.segment.buf, self._offset(1 - self.out_index), self.ring_bytes, **waiting)


def connector_side(sock: socket.socket, rank: int, world_size: int, rings: bool = True) -> Pairing | None:
    """Run the connector's part (rank ``rank`` connecting to a lower rank) on ``sock``
    (``rings`` False: ask for none)."""
    ring = wanted_ring_bytes(world_size) if rings and enabled() else 0
    digest = host_digest(rank) if ring else NO_HOST
    sock.sendall(_WANT.pack(digest, ring))
    size, ring, min_bytes, nonce, path = _OFFER.unpack(recv_exact(sock, _OFFER.size))
    if not size:
        return None
    segment = None
    try:
        segment = Segment.attach(path.rstrip(b"\0").decode(), size)
        if _SEG.unpack_from(segment.buf, 0) != (MAGIC, ring, nonce):
            raise OSError("the file holds another segment (a different /dev/shm?)")
    except (OSError, ValueError) as exc:
        _warn_once(f"chorus rank {rank}: cannot map the shared-memory rings a peer offered ({exc}); "
                   "point-to-point with it uses the socket")
        if segment is not None:
            segment.close()
        segment = None
    sock.sendall(b"\x01" if segment is not None else b"\x00")
    return None if segment is None else Pairing(segment, ring, min_bytes, 0)


def acceptor_side(sock: socket.socket, rank: int, peer: int, world_size: int,
                  deadline: float | None = None, rings: bool = True) -> Pairing | None:
    """Run the acceptor's part (rank ``rank`` accepting rank ``peer``) on ``sock``; its
    reads end by ``deadline`` (time.monotonic(); TimeoutError); ``rings`` False: offer none."""
    digest, their_ring = _WANT.unpack(recv_exact(sock, _WANT.size, deadline))
    ring = wanted_ring_bytes(world_size) if rings and enabled() else 0
    ring = min(ring, their_ring)
    if not ring or digest == NO_HOST or digest != host_digest(rank):
        sock.sendall(_OFFER.pack(0, 0, 0, b"", b""))
        return None
    size = HEADER + 2 * ring_size(ring)
    try:
        _check_room(size)
        segment = Segment.create(size, f"p{rank}.{peer}")  # named like a group's, for sweep()
    except OSError as exc:
        _warn_once(f"chorus rank {rank}: no shared-memory rings with rank {peer} ({exc}); "
                   "point-to-point between them uses the socket")
        sock.sendall(_OFFER.pack(0, 0, 0, b"", b""))
        return None
    try:
        nonce = secrets.token_bytes(16)
        _SEG.pack_into(segment.buf, 0, MAGIC, ring, nonce)
        min_bytes = max(1, config.get("CHORUS_SHM_P2P_MIN"))
        sock.sendall(_OFFER.pack(size, ring, min_bytes, nonce, segment.path.encode()))
        mapped = recv_exact(sock, 1, deadline) == b"\x01"
    except BaseException:
        segment.close()
        raise
    finally:
        segment.unlink()
    if not mapped:
        segment.close()
        return None
    return Pairing(segment, ring, min_bytes, 1)


def ring_ends(pairing: Pairing, *, peer: int, bell: Callable[[], None],
              doze: Callable[[float], bool], gone: Callable[[], str | None]
              ) -> tuple[RingWriter, RingReader]:
    """This end's writer and reader for a connection to ``peer`` (see chorus.transport.ring for
    ``bell`` and ``doze``).  ``gone()`` says why the peer will read no more (it died or
    left; None while it may), which ends a writer's wait for space."""

    def check() -> None:
        why = gone()
        if why is not None:
            raise ConnectionError(f"rank {peer} {why}; it will not read the rest of this message")

    waiting = {"piece": PIECE, "yield_s": YIELD_S}
    return (pairing.writer(bell=bell, check=check, **waiting),
            pairing.reader(doze=doze, peer=peer, **waiting))
