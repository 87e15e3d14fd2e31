"""Reduce-scatter: block i of the reduction over all ranks' ``input`` lands in rank i's
``output``.  Blocks may differ in size: ``counts[i]`` elements for rank i, block i at
offset sum(counts[:i]) of ``input``; ``input`` is unchanged (partial sums go to scratch).

Per rank, W = 3, ``x_i`` = block i of rank x's input::

    before:  rank 0: a0 a1 a2      rank 1: b0 b1 b2      rank 2: c0 c1 c2
    after:   rank 0: a0+b0+c0      rank 1: a1+b1+c1      rank 2: a2+b2+c2
"""

from __future__ import annotations

from collections.abc import Sequence

from chorus.schedules.base import Region, Schedule
from chorus.schedules.chunks import blocks, check_args, copies, finish, recvs, ring_pass, sends


def ring_reduce_scatter(rank: int, world: int, counts: Sequence[int]) -> Schedule:
    """Partial sums travel around the ring; block b is summed along b+1 -> ... -> b.

    W = 4, ``X3`` = rank X's block 3 (inputs a b c d); step s, rank r sends block
    r - s - 1 right and reduces block r - s - 2 from the left::

        step   rank 0          rank 1          rank 2          rank 3
        0      a3 -> 1         b0 -> 2         c1 -> 3         d2 -> 0
        1      (d2+a2) -> 1    (a3+b3) -> 2    (b0+c0) -> 3    (c1+d1) -> 0
        2      (c1+d1+a1) -> 1 ...             ...             ...
        end    out = a0+b0+c0+d0   out = ..1   out = ..2       out = ..3

    Step 0 sends straight from ``input``; the blocks a rank reduces into start as Copies
    of its input in ``scratch`` (its own block in ``output``), so ``input`` stays as is.
    Cost: W - 1 steps; sends every block but its own once (sum(counts) - counts[r]
    elements) and reduces as many.
    """
    counts = _check(rank, world, counts)
    inputs, acc = blocks("input", counts), list(blocks("scratch", counts))
    acc[rank] = Region("output", 0, counts[rank])
    send_from = list(acc)
    send_from[(rank - 1) % world] = inputs[(rank - 1) % world]
    setup = tuple(op for b in range(world) if b != (rank - 1) % world or world == 1
                  for op in copies(inputs[b], acc[b]))
    steps = [setup] + ring_pass(rank, world, send_from, acc, shift=1, reduce=True, tag=0)
    return finish(steps, scratch=sum(counts) if world > 2 else 0)


def pairwise_reduce_scatter(rank: int, world: int, counts: Sequence[int]) -> Schedule:
    """In step k rank r sends its raw block r + k to rank r + k and reduces block r
    arriving from rank r - k into its output; good for uneven or small blocks.

    W = 4, inputs a b c d::

        step   rank 0              rank 1              rank 2   rank 3
        0      out = a0            out = b1            out = c2 out = d3
        1      a1 -> 1, += d0      b2 -> 2, += a1      ...      ...
        2      a2 -> 2, += c0      b3 -> 3, += d1      ...      ...
        3      a3 -> 3, += b0      b0 -> 0, += c1      ...      ...

    Cost: W - 1 steps; sends all of its input but its own block, and receives and
    reduces counts[r] elements W - 1 times.
    """
    counts = _check(rank, world, counts)
    inputs, out = blocks("input", counts), Region("output", 0, counts[rank])
    steps = [copies(inputs[rank], out)]
    for k in range(1, world):
        to, frm = (rank + k) % world, (rank - k) % world
        steps.append(sends(to, inputs[to], k) + recvs(frm, out, k, reduce=True))
    return finish(steps)


def _check(rank: int, world: int, counts: Sequence[int]) -> tuple[int, ...]:
    counts = tuple(counts)
    check_args(rank, world, counts=counts)
    if len(counts) != world:
        raise ValueError(f"reduce_scatter needs one count per rank: got {len(counts)} "
                         f"counts for a group of {world}")
    return counts
