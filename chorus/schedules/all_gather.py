"""All-gather: every rank's ``input`` (count elements) lands in block r of every rank's
``output`` (W * count elements, block r at offset r * count); ``input`` is unchanged.

Per rank::

    before:  rank 0: input = a    rank 1: input = b    rank 2: input = c
    after:   every rank: output = a b c
"""

from __future__ import annotations

from chorus.schedules.base import Region, Schedule
from chorus.schedules.chunks import (
    blocks,
    ceil_log2,
    check_args,
    copies,
    finish,
    recvs,
    ring_pass,
    sends,
    wrapped_blocks,
)


def ring_all_gather(rank: int, world: int, count: int) -> Schedule:
    """Each block travels once around the ring; in step s rank r forwards block r - s.

    W = 4, inputs a b c d (``out[i]`` is block i of output)::

        step   rank 0             rank 1             rank 2             rank 3
        0      a -> 1, <- d       b -> 2, <- a       c -> 3, <- b       d -> 0, <- c
        1      out[3] -> 1, <- c  out[0] -> 2, <- d  out[1] -> 3, <- a  out[2] -> 0, <- b
        2      out[2] -> 1, <- b  out[3] -> 2, <- c  out[0] -> 3, <- d  out[1] -> 0, <- a

    Step 0 also copies the rank's own input into its block (and sends straight from
    ``input``, since a step may not send what it writes).
    Cost: W - 1 steps; sends (W-1) * count elements per rank.
    """
    check_args(rank, world, counts=(count,))
    source = Region("input", 0, count)
    out = blocks("output", (count,) * world)
    send_from = out[:rank] + (source,) + out[rank + 1:]
    steps = ring_pass(rank, world, send_from, out, shift=0, reduce=False, tag=0) or [()]
    steps[0] = copies(source, out[rank]) + steps[0]
    return finish(steps)


def bruck_all_gather(rank: int, world: int, count: int) -> Schedule:
    """Bruck's algorithm: after step k rank r holds blocks r .. r + 2^(k+1) - 1 (mod W),
    because in step k it receives from r + 2^k the blocks that rank already holds.

    W = 5, inputs a b c d e; "held" is what each rank holds after the step::

        step  distance  rank 0 sends to 4, <- 1    held by rank 0    held by rank 3
        0     1         a -> 4,  <- b              a b               d e
        1     2         ab -> 3, <- cd             a b c d           d e a b
        2     4         a -> 1,  <- e              a b c d e         d e a b c

    The last step sends only the W - 2^k blocks still missing.  Blocks sit at their
    final place in ``output`` all along, so a run that wraps past block W-1 goes as two
    messages instead of a rotated copy.
    Cost: ceil(log2 W) steps (latency-optimal); sends (W-1) * count elements per rank.
    """
    check_args(rank, world, counts=(count,))
    source = Region("input", 0, count)
    steps = [copies(source, Region("output", rank * count, count))]
    for k in range(ceil_log2(world)):
        distance = 1 << k
        n = min(distance, world - distance)
        mine = (source,) if k == 0 else wrapped_blocks("output", rank, n, world, count)
        theirs = wrapped_blocks("output", (rank + distance) % world, n, world, count)
        steps.append(sends((rank - distance) % world, mine, k)
                     + recvs((rank + distance) % world, theirs, k))
    if len(steps) > 1:  # the copy may share step 0: it writes only the rank's own block
        steps[:2] = [steps[0] + steps[1]]
    return finish(steps)
