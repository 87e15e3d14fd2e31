"""In-process transport: ranks are threads of one process (tier-1 tests, simulation).

A :class:`LoopbackFabric` connects ``world_size`` :class:`LoopbackTransport` objects.
A send copies the payload straight into the receiver's posted buffer, or into a stash
if the receive is not posted yet, and completes at once (eager protocol).
``fabric.kill(rank)`` makes a rank vanish, as a crashed process would.
"""

from __future__ import annotations

import threading

from chorus.transport.base import Transport
from chorus.transport.handles import Handle
from chorus.wire.frames import (
    HEADER_SIZE,
    LOST_REASON_TEXT,
    Kind,
    abort_parties,
    failed_text,
    unpack_header,
)


class LoopbackFabric:
    """The shared wiring of one in-process job."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._lock = threading.Lock()
        self.transports: dict[int, LoopbackTransport] = {}

    def transport(self, rank: int) -> LoopbackTransport:
        with self._lock:
            if rank in self.transports:
                raise ValueError(f"rank {rank} already has a loopback transport in this fabric")
            t = LoopbackTransport(rank, self.world_size, self)
            self.transports[rank] = t
            return t

    def peer(self, rank: int) -> LoopbackTransport | None:
        return self.transports.get(rank)

    def kill(self, rank: int) -> None:
        """Simulate the death of ``rank``: every other rank notices at once."""
        with self._lock:
            victim = self.transports.pop(rank, None)
        if victim is not None:
            victim.closed_reason = "killed"
        for t in list(self.transports.values()):
            t.peer_died(rank, "died (killed in the loopback fabric)")  # as if each saw EOF


class LoopbackTransport(Transport):
    name = "loopback"

    def __init__(self, rank: int, world_size: int, fabric: LoopbackFabric):
        super().__init__(rank, world_size)
        self._fabric = fabric

    def _send_frame(self, peer: int, header: bytes, view: memoryview, handle: Handle, sync: bool) -> None:
        target = self._fabric.peer(peer)
        if target is None:
            self.peer_died(peer, "is not running (no loopback transport for it)")
            handle.complete(error=self._lost_error(peer, "is not running", handle.group))
            return
        h = unpack_header(header)
        target._arrive(self.rank, h, view)
        handle.complete(h)

    def _notify(self, ranks: list[int], frame: bytes) -> None:
        h = unpack_header(frame[:HEADER_SIZE])
        for rank in ranks:
            target = self._fabric.peer(rank)
            if target is None:
                continue
            if h.kind == Kind.FAILED:
                target.peer_failed(h.tag, failed_text(frame[HEADER_SIZE:]), self.rank)
            elif h.kind == Kind.ABORT:
                culprit, detector = abort_parties(h.tag, self.rank)
                target.group_mismatch(h.group, culprit, h.seq, h.fingerprint, detector)
            elif h.kind == Kind.PEER_LOST:
                target.peer_died(h.tag, f"{LOST_REASON_TEXT.get(h.seq, 'was lost')} (reported by rank {self.rank})",
                                 h.seq)
            elif h.kind == Kind.MATCHED:
                target.sends.matched(self.rank, h.seq)
            elif h.kind == Kind.PROBE:
                target.on_probe(self.rank, h.seq, frame[HEADER_SIZE:])

    def _arrive(self, source: int, header, view: memoryview) -> None:
        match = self._matcher.claim(source, header)
        if isinstance(match, Handle):
            match.peer = source
            error = self._fits(match, header, source)
            if error is None and header.nbytes:
                match.view[:] = view
            match.complete(header, error)
            if header.seq and header.kind == Kind.DATA:
                self.answer(source, header)
            return
        self.stashed(source, header)
        claimant = self._matcher.arrival_ready(match, memoryview(bytes(view)))
        if claimant is not None:
            self._fill_from_stash(claimant, match)

    def close(self) -> None:
        super().close()
        for t in list(self._fabric.transports.values()):
            if t is not self:
                t.peer_left(self.rank)
