"""Creating a group's window: who creates it, who attaches, and when its name disappears.

Run by every member when a group is created (``init_process_group``, ``new_group``),
over the group's transport::

    member m > 0                               group rank 0
    --- host digest (chorus.shm.hostid) --->
                                               all digests equal and usable?
                                                 create the file, write a random nonce
    <-- offer: path, size, nonce (or none) --
    map it, check the nonce
    --- attached / failed ----------------->
                                               UNLINK the file: every member has mapped
                                               it (or given up); no name is left behind
    <-- verdict: use it / use TCP ----------

From the unlink on, the window exists only as the members' mappings and vanishes with
them, whatever way they end (``kill -9`` included).  Only a rank 0 killed between
creating and unlinking (milliseconds) leaves a file, named after the job for
``chorus.shm.segment.sweep``.  A group of one rank creates and unlinks at once.

Shared memory is used only when *every* member is on this host (mixed groups keep TCP
for now); ``CHORUS_TRANSPORT=tcp`` turns it off, ``=shm`` makes its absence an error.
"""

from __future__ import annotations

import logging
import secrets
import struct
import time

from chorus.errors import InvalidArgumentError
from chorus.shm.group import ShmGroup, backoff_for, platform_ok, slot_bytes, transport_mode
from chorus.shm.hostid import NO_HOST, host_digest
from chorus.shm.segment import Segment
from chorus.shm.window import Layout, check_header, write_header
from chorus.wire.frames import Kind

log = logging.getLogger("chorus")

TAG = -0x43485348  # "CHSH": the handshake's point-to-point tag (users' tags are other numbers)
_OFFER = struct.Struct("<QQ16s256s")  # window bytes (0: no window), slot bytes, nonce, path
NO, YES, FORCED_BUT_IMPOSSIBLE = 0, 1, 2


def create(transport, group: int, members: tuple[int, ...], rank: int, timeout: float) -> ShmGroup | None:
    """The group's ShmGroup for this member (group rank ``rank``), or None to use TCP."""
    mode = transport_mode()
    wanted = mode == "shm" or (mode == "auto" and platform_ok())
    digest = host_digest(members[rank]) if wanted else NO_HOST
    talk = _Talk(transport, group, members, time.monotonic() + timeout)
    if rank == 0:
        return _lead(talk, digest, mode, members)
    return _follow(talk, digest, rank)


def _lead(talk: _Talk, digest: bytes, mode: str, members: tuple[int, ...]) -> ShmGroup | None:
    world = len(members)
    digests = talk.gather(32)
    why = _refusal([digest, *digests], members)
    layout = Layout(world, slot_bytes(world))
    segment, trouble = None, False  # trouble: shared memory should have worked but did not
    if why is None:
        try:
            segment = Segment.create(layout.size, talk.group)
        except OSError as exc:
            why, trouble = str(exc), True
    try:
        if segment is None:
            talk.scatter(_OFFER.pack(0, 0, b"", b""))
            talk.gather(1)
            verdict = FORCED_BUT_IMPOSSIBLE if mode == "shm" else NO
        else:
            nonce = secrets.token_bytes(16)
            write_header(segment.buf, layout, nonce)
            talk.scatter(_OFFER.pack(layout.size, layout.slot, nonce, segment.path.encode()))
            acks = talk.gather(1)
            failed = [members[i + 1] for i, a in enumerate(acks) if a != b"\x01"]
            if failed:
                why, trouble = f"rank(s) {failed} could not map the window (see their log)", True
                verdict = FORCED_BUT_IMPOSSIBLE if mode == "shm" else NO
            else:
                verdict = YES
    finally:
        if segment is not None:
            segment.unlink()
    talk.scatter(bytes([verdict]))
    if verdict == YES:
        return ShmGroup(segment, layout, 0, members, talk.transport, talk.group, _backoff(talk, world))
    if segment is not None:
        segment.close()
    if why and world > 1:
        (log.warning if trouble else log.info)("chorus: group %d uses TCP, not shared memory: %s",
                                               talk.group, why)
    _raise_if_forced(verdict, talk.group, why)
    return None


def _follow(talk: _Talk, digest: bytes, rank: int) -> ShmGroup | None:
    talk.send_to_lead(digest)
    size, slot, nonce, path = _OFFER.unpack(talk.recv_from_lead(_OFFER.size))
    segment, layout = None, Layout(len(talk.members), slot) if size else None
    if size:
        try:
            segment = Segment.attach(path.rstrip(b"\0").decode(), size)
            if layout.size != size or not check_header(segment.buf, layout, nonce):
                raise OSError("the file holds another window (a different /dev/shm?)")
        except (OSError, ValueError) as exc:
            log.warning("chorus: rank %d cannot map group %d's shared-memory window: %s",
                        talk.members[rank], talk.group, exc)
            if segment is not None:
                segment.close()
            segment = None
    talk.send_to_lead(b"\x01" if segment is not None else b"\x00")
    verdict = talk.recv_from_lead(1)[0]
    if verdict == YES:
        return ShmGroup(segment, layout, rank, talk.members, talk.transport, talk.group,
                        _backoff(talk, len(talk.members)))
    if segment is not None:
        segment.close()
    _raise_if_forced(verdict, talk.group, "see group rank 0's log")
    return None


def _refusal(digests: list[bytes], members: tuple[int, ...]) -> str | None:
    """Why the group cannot share memory, or None if it can."""
    if any(d == NO_HOST for d in digests):
        off = [members[i] for i, d in enumerate(digests) if d == NO_HOST]
        return f"rank(s) {off} have no usable /dev/shm or run with CHORUS_TRANSPORT=tcp"
    if len(set(digests)) > 1:
        away = [members[i] for i, d in enumerate(digests) if d != digests[0]]
        return f"rank(s) {away} are on another host than rank {members[0]}"
    return None


def _backoff(talk: _Talk, world: int):
    threads = talk.transport.name == "loopback"  # ranks are threads of this process
    return backoff_for(max(world, talk.transport.world_size), threads)


def _raise_if_forced(verdict: int, group: int, why: str | None) -> None:
    if verdict == FORCED_BUT_IMPOSSIBLE:
        raise InvalidArgumentError(f"CHORUS_TRANSPORT=shm but group {group} cannot use shared memory: "
                                   f"{why}. Use CHORUS_TRANSPORT=auto to fall back to TCP.")


class _Talk:
    """Fixed-size messages between group rank 0 and the other members."""

    def __init__(self, transport, group: int, members: tuple[int, ...], deadline: float):
        self.transport = transport
        self.group = group
        self.members = members
        self.deadline = deadline

    def _wait(self, handles: list) -> None:
        self.transport.wait_all(handles, self.deadline,
                                lambda: f"setting up group {self.group}'s shared-memory window")

    def _send(self, peer: int, data: bytes):
        return self.transport.isend(peer, memoryview(data), kind=Kind.DATA, group=self.group, tag=TAG,
                                    sync=True)

    def _recv(self, peer: int, view: memoryview):
        return self.transport.irecv(peer, view, kind=Kind.DATA, group=self.group, tag=TAG)

    def gather(self, nbytes: int) -> list[bytes]:
        peers = self.members[1:]
        bufs = [bytearray(nbytes) for _ in peers]
        self._wait([self._recv(peer, memoryview(b)) for peer, b in zip(peers, bufs, strict=True)])
        return [bytes(b) for b in bufs]

    def scatter(self, data: bytes) -> None:
        self._wait([self._send(peer, data) for peer in self.members[1:]])

    def send_to_lead(self, data: bytes) -> None:
        self._wait([self._send(self.members[0], data)])

    def recv_from_lead(self, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        self._wait([self._recv(self.members[0], memoryview(buf))])
        return bytes(buf)
