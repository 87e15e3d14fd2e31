"""All-to-all: block j of rank i's ``input`` lands in block i of rank j's ``output`` (a
transpose).  ``send_counts[j]`` elements go to rank j (prefix offsets in ``input``),
``recv_counts[i]`` arrive from rank i (prefix offsets in ``output``).

Per rank, W = 3, ``xj`` = rank x's block for rank j::

    before:  rank 0: a0 a1 a2     rank 1: b0 b1 b2     rank 2: c0 c1 c2
    after:   rank 0: a0 b0 c0     rank 1: a1 b1 c1     rank 2: a2 b2 c2
"""

from __future__ import annotations

from collections.abc import Sequence

from chorus.schedules.base import Region, Schedule
from chorus.schedules.chunks import (
    blocks,
    ceil_log2,
    check_args,
    copies,
    finish,
    recvs,
    sends,
    wrap_pieces,
)


def pairwise_all_to_all(rank: int, world: int, send_counts: Sequence[int],
                        recv_counts: Sequence[int]) -> Schedule:
    """In step k rank r sends its block for r + k and receives the block from r - k.

    W = 4::

        step   rank 0             rank 1             rank 2             rank 3
        1      a1 -> 1, <- d0     b2 -> 2, <- a1     c3 -> 3, <- b2     d0 -> 0, <- c3
        2      a2 -> 2, <- c0     b3 -> 3, <- d1     c0 -> 0, <- a2     d1 -> 1, <- b3
        3      a3 -> 3, <- b0     b0 -> 0, <- c1     c1 -> 1, <- d2     d2 -> 2, <- a3

    Step 1 also copies the rank's own block.  Blocks may have any size (an empty block
    costs no message).  Cost: W - 1 steps; sends sum(send_counts) - send_counts[r].
    """
    send_counts, recv_counts = _check(rank, world, send_counts, recv_counts)
    inputs, outputs = blocks("input", send_counts), blocks("output", recv_counts)
    steps = [copies(inputs[rank], outputs[rank])]
    for k in range(1, world):
        to, frm = (rank + k) % world, (rank - k) % world
        steps.append(sends(to, inputs[to], k) + recvs(frm, outputs[frm], k))
    if world > 1:  # the copy touches only the own blocks, so it rides along step 1
        steps[:2] = [steps[0] + steps[1]]
    return finish(steps)


def linear_all_to_all(rank: int, world: int, send_counts: Sequence[int],
                      recv_counts: Sequence[int]) -> Schedule:
    """Every block at once: one step with all W - 1 sends and W - 1 receives posted.

    W = 4, one step::

        rank 0: a1 -> 1, a2 -> 2, a3 -> 3   and   <- b0, <- c0, <- d0   (a0 copied)

    The transport keeps all of them in flight, so the op costs one latency plus the
    bytes; best for small blocks (large ones contend for the links: use pairwise).
    Cost: 1 step; sends sum(send_counts) - send_counts[r].
    """
    send_counts, recv_counts = _check(rank, world, send_counts, recv_counts)
    inputs, outputs = blocks("input", send_counts), blocks("output", recv_counts)
    step = copies(inputs[rank], outputs[rank])
    for k in range(1, world):
        to, frm = (rank + k) % world, (rank - k) % world
        step += sends(to, inputs[to], 0) + recvs(frm, outputs[frm], 0)
    return finish([step])


def bruck_all_to_all(rank: int, world: int, send_counts: Sequence[int],
                     recv_counts: Sequence[int]) -> Schedule:
    """Bruck's index algorithm for equal blocks: ceil(log2 W) steps instead of W - 1.

    1. rotate: ``A[i]`` = the block for rank r + i (two Copies into scratch);
    2. step k: the blocks at positions i with bit k set go to rank r + 2^k, and the
       same positions arrive from r - 2^k; a block at position i has then travelled
       i ranks when all bits are done, so ``A[i]`` holds the block from rank r - i;
    3. unrotate: ``output[r - i] = A[i]``.

    W = 4, rank 0 (``xj`` = rank x's block for j; bit 0 moves positions 1 and 3,
    bit 1 moves positions 2 and 3)::

        after      A[0]  A[1]  A[2]  A[3]
        rotate     a0    a1    a2    a3
        bit 0      a0    d0    a2    d2      (a1 a3 went to rank 1)
        bit 1      a0    d0    c0    b0      (a2 d2 went to rank 2)
        unrotate   output = a0 b0 c0 d0

    Positions that stay are copied between two halves of ``scratch`` in the same step
    (a step may not receive into the region it sends).  For small blocks, where latency
    dominates.  Cost: ceil(log2 W) steps; sends about W/2 * ceil(log2 W) blocks.
    """
    send_counts, recv_counts = _check(rank, world, send_counts, recv_counts)
    size = send_counts[0]
    if any(c != size for c in send_counts + recv_counts):
        raise ValueError("bruck all_to_all needs the same count for every block (got send "
                         f"counts {send_counts}, recv counts {recv_counts}); use 'pairwise'")
    halves = (blocks("scratch", (size,) * world), blocks("scratch", (size,) * world, world * size))
    steps = [tuple(op for start, n in wrap_pieces(rank, world, world)
                   for op in copies(Region("input", start * size, n * size),
                                    _run(halves[0], (start - rank) % world, n)))]
    for k in range(ceil_log2(world)):
        bit, here, there = 1 << k, halves[k % 2], halves[1 - k % 2]
        step = ()
        for start in range(0, world, bit):
            run = min(bit, world - start)
            if start & bit:
                step += (sends((rank + bit) % world, _run(here, start, run), k)
                         + recvs((rank - bit) % world, _run(there, start, run), k))
            else:
                step += copies(_run(here, start, run), _run(there, start, run))
        steps.append(step)
    final = halves[ceil_log2(world) % 2]
    steps.append(tuple(op for i in range(world)
                       for op in copies(final[i], Region("output", (rank - i) % world * size,
                                                         size))))
    return finish(steps, scratch=2 * world * size)


def _run(half: tuple[Region, ...], start: int, n: int) -> Region:
    """Positions start .. start+n-1 of one scratch half as one region."""
    return Region(half[start].buffer, half[start].offset, n * half[start].count)


def _check(rank: int, world: int, send_counts: Sequence[int],
           recv_counts: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    send_counts, recv_counts = tuple(send_counts), tuple(recv_counts)
    check_args(rank, world, counts=send_counts + recv_counts)
    if len(send_counts) != world or len(recv_counts) != world:
        raise ValueError(f"all_to_all needs one send and one recv count per rank: got "
                         f"{len(send_counts)} and {len(recv_counts)} for a group of {world}")
    if send_counts[rank] != recv_counts[rank]:
        raise ValueError(f"rank {rank} sends itself {send_counts[rank]} elements but "
                         f"expects {recv_counts[rank]}")
    return send_counts, recv_counts
