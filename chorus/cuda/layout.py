"""Where everything lives in a group's CUDA workspace, and in its host control page.

One workspace per rank (``cudaMalloc``, mapped by every peer through CUDA IPC), laid out
for group size W::

    offset
    0          control (4 KiB)   word 0: this rank's barrier epoch (read and written only
                                 by its own barrier kernel: the count of barriers so far)
    BARRIER    W words           [r] = the latest barrier epoch rank r reached (written by r)
    READY      W words           [q] = chunks rank q has posted to this rank's channel from q
    ACK        W words           [r] = chunks rank r has consumed from this rank's channel to r
    CHECK      W words           the attach-time test pattern
    FPRINT     2 x W words       [p][r] = the fingerprint of rank r's op at its latest barrier
                                 of parity p (written by r with its epoch; the barrier
                                 kernel compares them: a mismatched collective)
    4096       slot, parity 0    collectives: each rank writes only its own slots; peers read
    +S         slot, parity 1      (round k uses parity k % 2: one barrier per round suffices)
    2S+4096    channels          for each destination d and parity p: a 256-byte header
                                 (tag, nbytes of the message) and C data bytes; rank q's
                                 channel to d carries q's sends to d, d copies out of it

Half of the workspace goes to the two collective slots, half to the W x 2 channels.

The control page is page-locked host memory mapped into the device (one per group and
rank): the host sets ABORT when the transport reports a failure; a kernel that gives up
writes why into the other words (STATUS last); a barrier that finds another rank's op
fingerprint writes MISMATCH with that rank (FAIL_PEERS) and its fingerprint (FAIL_FP);
a mismatched point-to-point tag is recorded in the TAG_* words without breaking the
group.
"""

from __future__ import annotations

from typing import NamedTuple

MAX_WORLD = 64
CONTROL_BYTES = 4096
EPOCH = 0
BARRIER = 512
READY = BARRIER + 8 * MAX_WORLD
ACK = READY + 8 * MAX_WORLD
CHECK = ACK + 8 * MAX_WORLD
FPRINT = CHECK + 8 * MAX_WORLD  # parity p's words start at FPRINT + p * FPRINT_PARITY
FPRINT_PARITY = 8 * MAX_WORLD
assert FPRINT + 2 * FPRINT_PARITY <= CONTROL_BYTES
CHANNEL_HEADER = 256
ALIGN = 256

# -- the host control page (int64 words) ---------------------------------------------------
ABORT = 0  # host -> device: stop spinning
STATUS = 1  # device -> host: why a kernel gave up (below); 0 = fine
FAIL_OP = 2  # the op id the kernel belonged to
FAIL_WHAT = 3  # what it waited for: WAIT_BARRIER, WAIT_READY or WAIT_ACK
FAIL_PEERS = 4  # bitmask of the group ranks that never arrived (MISMATCH: that called another op)
FAIL_EXPECT = 5  # size mismatch: the bytes this rank expected
FAIL_GOT = 6  # ... and what the sender's header said
FAIL_FP = 7  # mismatch: the fingerprint of the lowest rank in FAIL_PEERS
TAG_OP = 8  # a point-to-point tag mismatch (not fatal): op id + 1 (0 = none)
TAG_PEER = 9
TAG_EXPECT = 10
TAG_GOT = 11
CONTROL_WORDS = 16

OK, TIMEOUT, ABORTED, SIZE_MISMATCH, MISMATCH = 0, 1, 2, 3, 4
WAIT_BARRIER, WAIT_READY, WAIT_ACK = 0, 1, 2


def _down(n: int) -> int:
    return n // ALIGN * ALIGN


class Layout(NamedTuple):
    """Offsets of one rank's workspace for a group of ``world`` ranks (all ranks share it)."""

    world: int
    total: int
    slot: int  # bytes of one collective slot (one parity)
    channel: int  # data bytes of one channel slot (one destination, one parity)

    @staticmethod
    def of(world: int, total: int) -> Layout:
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"chorus.cuda supports groups of 1..{MAX_WORLD} ranks, not {world}")
        body = total - CONTROL_BYTES
        slot = _down(body // 4)
        channel = _down(body // 2 // (2 * world) - CHANNEL_HEADER)
        if slot < ALIGN * world or channel < ALIGN:
            raise ValueError(f"a workspace of {total} bytes is too small for {world} ranks")
        return Layout(world, total, slot, channel)

    def slot_at(self, parity: int) -> int:
        return CONTROL_BYTES + parity * self.slot

    def piece(self) -> int:
        """Bytes of one destination's share of a slot (scatter, reduce_scatter), aligned."""
        return _down(self.slot // self.world)

    def channel_at(self, dest: int, parity: int) -> int:
        """Offset of the header of the channel slot to ``dest`` of ``parity``; data follows."""
        return CONTROL_BYTES + 2 * self.slot + (2 * dest + parity) * (CHANNEL_HEADER + self.channel)
