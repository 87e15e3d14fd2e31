"""Where everything lives in a group's CUDA workspace, and in its host control page.

One workspace per rank (``cudaMalloc``, mapped by every peer through CUDA IPC), laid out
for group size W::

    offset
    0          control (4 KiB)   word 0: this rank's barrier epoch (read and written only
                                 by its own barrier kernel: the count of barriers so far)
    BROKEN     1 word            nonzero once a kernel of this rank gave up: its STATUS,
                                 also written to the control page; every kernel reads it
                                 here at its start (the page is host memory: a read costs
                                 microseconds, and the GPU serves the reads of a kernel's
                                 blocks one after another)
    BARRIER    W words           [r] = the latest barrier epoch rank r reached (written by r)
    READY      W words           [q] = chunks rank q has posted to this rank's channel from q
    ACK        W words           [r] = chunks rank r has consumed from this rank's channel to r
    CHECK      W words           the attach-time test pattern
    FPRINT     2 x W words       [p][r] = the fingerprint of rank r's op at its latest barrier
                                 of parity p (written by r with its epoch; the barrier
                                 kernel compares them: a mismatched collective)
    BLOCKS     per-block words   the fused all_reduce kernels (chorus.cuda.fused) sync
                                 block by block: block b >= 1 of every rank has its own
                                 BARRIER and 2 x FPRINT words here (BLOCK_STRIDE bytes per
                                 block); block 0 uses the words above, so a fused kernel
                                 and the barrier kernel meet (and compare fingerprints)
    GRAPH_*    3 words           the kernels captured in CUDA graphs count on the device
                                 (their launch arguments are frozen at capture): GRAPH_OPS
                                 their launches so far (a launch's slot parity), GRAPH_EPOCH
                                 their barriers so far (a launch's epochs), GRAPH_DONE its
                                 blocks that finished (the last one advances both counts)
    REPLAY_DONE 1 word           the blocks of a lane's replayed kernel that finished (the
                                 last one stores EPOCH: chorus.cuda.fused.graph_end)
    HOST_POLL  1 word            the globaltimer time of the last read of the control page
                                 by a spinning block of this rank's fused kernels: one block
                                 claims each HOST_POLL_NS to read ABORT (chorus.cuda.fused)
    GRAPH_BLOCKS per-block words   block b (every b) of a captured kernel: BARRIER[W] and
                                 2 x FPRINT[W], as BLOCKS' (apart: eager and captured ops
                                 count their epochs separately)
    CONTROL    slot, parity 0    collectives: each rank writes only its own slots; peers read
    +S         slot, parity 1      (round k uses parity k % 2: one barrier per round suffices)
    2S         graph slot, x 2   the slots of captured kernels (parity: GRAPH_OPS % 2)
    2S+2G      channels          for each destination d and parity p: a 256-byte header
                                 (tag, nbytes of the message) and C data bytes; rank q's
                                 channel to d carries q's sends to d, d copies out of it

CONTROL_BYTES (about 387 KiB) holds the control words.  Of the rest, a sixteenth goes to
each graph slot, and of what remains a quarter to each collective slot and half to the
W x 2 channels.

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
EPOCH = 0
BROKEN = 8
BARRIER = 512
READY = BARRIER + 8 * MAX_WORLD
ACK = READY + 8 * MAX_WORLD
CHECK = ACK + 8 * MAX_WORLD
FPRINT = CHECK + 8 * MAX_WORLD  # parity p's words start at FPRINT + p * FPRINT_PARITY
FPRINT_PARITY = 8 * MAX_WORLD
assert FPRINT + 2 * FPRINT_PARITY <= 4096
BLOCKS = 4096  # block b >= 1's words start at BLOCKS + (b - 1) * BLOCK_STRIDE
BLOCK_STRIDE = 3 * 8 * MAX_WORLD  # BARRIER[W] at +0, FPRINT[2][W] at +FPRINT_PARITY
MAX_BLOCKS = 128  # blocks (CTAs) of a fused kernel: all resident on an H100/H200 (132 SMs)
CHANNEL_HEADER = 256
ALIGN = 256
GRAPH_OPS, GRAPH_EPOCH, GRAPH_DONE = 16, 24, 32
HOST_POLL = 40
REPLAY_DONE = 48
#: a lane's replayed kernel reports op id REPLAY_OP + its first epoch (chorus.cuda.replays)
REPLAY_OP = 1 << 40
#: a rank's spinning fused kernels read the control page (pinned host memory, over PCIe)
#: about once per this many ns, by whichever block claims the turn: every block reading it
#: at once queues a kernel's blocks behind each other's reads (microseconds each)
HOST_POLL_NS = 20_000
GRAPH_BLOCKS = -(-(BLOCKS + (MAX_BLOCKS - 1) * BLOCK_STRIDE) // ALIGN) * ALIGN  # block b at + b * BLOCK_STRIDE
CONTROL_BYTES = GRAPH_BLOCKS + MAX_BLOCKS * BLOCK_STRIDE
assert CONTROL_BYTES % ALIGN == 0 and GRAPH_DONE < HOST_POLL < REPLAY_DONE and REPLAY_DONE + 8 <= BARRIER
#: elements one block of a fused kernel moves per step (the block count follows from it)
FUSED_BLOCK = 1024
#: block ranges and slices are multiples of this many elements: 16-byte aligned for every
#: dtype, so the kernels' vector loads may assume it
GRAIN = 64

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


def block_barrier(block: int) -> int:
    """Offset of block ``block``'s BARRIER words (a fused kernel's block; 0 = BARRIER)."""
    return BARRIER if block == 0 else BLOCKS + (block - 1) * BLOCK_STRIDE


def block_fprint(block: int, parity: int) -> int:
    """Offset of block ``block``'s FPRINT words of ``parity``."""
    return (FPRINT if block == 0 else BLOCKS + (block - 1) * BLOCK_STRIDE + FPRINT_PARITY) + parity * FPRINT_PARITY


def graph_barrier(block: int) -> int:
    """Offset of block ``block``'s BARRIER words in a captured kernel."""
    return GRAPH_BLOCKS + block * BLOCK_STRIDE


def graph_fprint(block: int, parity: int) -> int:
    """Offset of block ``block``'s FPRINT words of ``parity`` in a captured kernel."""
    return graph_barrier(block) + (1 + parity) * FPRINT_PARITY


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _up(n: int, m: int) -> int:
    return _cdiv(n, m) * m


def one_shot_geometry(n: int, max_blocks: int = MAX_BLOCKS, step: int = FUSED_BLOCK) -> tuple[int, int]:
    """(blocks, elements per block) of a one-shot all_reduce of ``n`` elements: block b
    copies, syncs and reduces elements [b * per, (b + 1) * per), the same range on every
    rank (so a per-block barrier is enough); ``per`` is a multiple of GRAIN.  ``step``:
    the elements a block moves at a time (a block per step, up to ``max_blocks``)."""
    blocks = max(1, min(max_blocks, _cdiv(n, step)))
    per = max(GRAIN, _up(_cdiv(n, blocks), GRAIN))
    return max(1, _cdiv(n, per)), per


def two_shot_geometry(n: int, world: int, max_blocks: int = MAX_BLOCKS,
                      step: int = FUSED_BLOCK) -> tuple[int, int, int]:
    """(blocks, elements per block, slice) of a two-shot all_reduce of ``n`` elements:
    slice s = elements [s * slice, (s + 1) * slice) (the last ones shorter or empty);
    block b owns elements [b * per, (b + 1) * per) of every slice, on every rank."""
    piece = max(GRAIN, _up(_cdiv(n, world), GRAIN))
    blocks = max(1, min(max_blocks, _cdiv(piece, step)))
    per = _up(_cdiv(piece, blocks), GRAIN)
    return _cdiv(piece, per), per, piece


def two_shot_chunk(slot_bytes: int, item: int, world: int) -> int:
    """The most elements one two-shot round moves through a slot of ``slot_bytes``."""
    return slot_bytes // item // (world * GRAIN) * (world * GRAIN)


class Layout(NamedTuple):
    """Offsets of one rank's workspace for a group of ``world`` ranks (all ranks share it)."""

    world: int
    total: int
    slot: int  # bytes of one collective slot (one parity)
    channel: int  # data bytes of one channel slot (one destination, one parity)
    graph: int = 0  # bytes of one graph slot (one parity)

    @staticmethod
    def of(world: int, total: int) -> Layout:
        if not 1 <= world <= MAX_WORLD:
            raise ValueError(f"chorus.cuda supports groups of 1..{MAX_WORLD} ranks, not {world}")
        body = total - CONTROL_BYTES
        graph = _down(body // 16)
        rest = body - 2 * graph
        slot = _down(rest // 4)
        channel = _down(rest // 2 // (2 * world) - CHANNEL_HEADER)
        if body < 0 or graph < ALIGN * world or slot < ALIGN * world or channel < ALIGN:
            raise ValueError(f"a workspace of {total} bytes is too small for {world} ranks")
        return Layout(world, total, slot, channel, graph)

    def slot_at(self, parity: int) -> int:
        return CONTROL_BYTES + parity * self.slot

    def graph_slot_at(self, parity: int) -> int:
        return CONTROL_BYTES + 2 * self.slot + parity * self.graph

    def piece(self) -> int:
        """Bytes of one destination's share of a slot (scatter, reduce_scatter), aligned."""
        return _down(self.slot // self.world)

    def channel_at(self, dest: int, parity: int) -> int:
        """Offset of the header of the channel slot to ``dest`` of ``parity``; data follows."""
        return CONTROL_BYTES + 2 * self.slot + 2 * self.graph + (2 * dest + parity) * (CHANNEL_HEADER + self.channel)
