"""All-reduce: every rank ends with op(x_0, x_1, ..., x_{W-1}) in its ``data`` buffer.

Per rank, in place::

    before:  rank 0: data = a      rank 1: data = b      rank 2: data = c
    after:   rank 0: data = a+b+c  rank 1: data = a+b+c  rank 2: data = a+b+c

Every rank's result is bit-identical: each element is reduced along one fixed chain (or
by two partners holding the same operands) and then copied, never recomputed in a
different order.  Costs are for n elements, W ranks, p = largest power of two <= W.
"""

from __future__ import annotations

from chorus.schedules.base import Copy, Region, Schedule, Step
from chorus.schedules.chunks import (
    aligned,
    blocks,
    check_args,
    copies,
    core_rank,
    finish,
    fold,
    pow2_floor,
    recvs,
    ring_pass,
    sends,
    span,
    split,
)


def ring_all_reduce(rank: int, world: int, count: int, *, segment: int = 0) -> Schedule:
    """Ring reduce-scatter then ring all-gather over W chunks of ``data`` (gloo/NCCL "ring").

    Theory of operation, W = 4, chunks A B C D; ``A1`` is rank 1's part of chunk A and
    ``A12`` = A1 + A2, the partial sum travelling with it::

        reduce-scatter: step s, rank r sends chunk r-s-1 right, reduces chunk r-s-2 from left
          step 0: 0 -D0->1     1 -A1->2     2 -B2->3     3 -C3->0
          step 1: 0 -C30->1    1 -D01->2    2 -A12->3    3 -B23->0
          step 2: 0 -B230->1   1 -C301->2   2 -D012->3   3 -A123->0
          now rank r holds chunk r complete:  0: A   1: B   2: C   3: D
        all-gather: step s, rank r sends chunk r-s right, stores chunk r-s-1 from left
          step 3: 0 -A->1      1 -B->2      2 -C->3      3 -D->0
          step 4: 0 -D->1      1 -A->2      2 -B->3      3 -C->0
          step 5: 0 -C->1      1 -D->2      2 -A->3      3 -B->0

    Chunk A is summed along the chain 1 -> 2 -> 3 -> 0 and only copied afterwards.
    With ``segment`` > 0 each chunk travels as several messages of at most ``segment``
    elements in the same step, so the receiver reduces piece k while k+1 arrives.
    Cost: 2(W-1) steps; sends 2(W-1)/W * n elements per rank; reduces (W-1)/W * n.
    """
    check_args(rank, world, counts=(count,))
    chunks = blocks("data", split(count, world))
    steps = ring_pass(rank, world, chunks, chunks, shift=1, reduce=True, tag=0, segment=segment)
    steps += ring_pass(rank, world, chunks, chunks, shift=0, reduce=False, tag=world,
                       segment=segment)
    return finish(steps)


def recursive_doubling_all_reduce(rank: int, world: int, count: int, *,
                                  segment: int = 0) -> Schedule:
    """Partners at distance 1, 2, 4, ... swap their whole partial results and both reduce.

    W = 4 (a, b, c, d are the inputs)::

        step   partners      after the step every rank holds
        1      0<->1 2<->3   0,1: a+b       2,3: c+d
        2      0<->2 1<->3   0..3: a+b+c+d

    Both partners compute op(lower rank's, higher rank's) from the same two operands,
    so they agree bit for bit (swapped operands give other bits for MIN/MAX of signed
    zeros and for numpy's complex product).  Each exchange sends a snapshot in ``scratch`` (a local Copy the step
    before) because a step may not send the region it reduces into.

    Non-powers of two fold first (W = 6: 0 -> 1 and 2 -> 3, the core is 1 3 4 5), run the
    exchange on the core and unfold (1 -> 0, 3 -> 2) at the end.
    Cost: log2(p) steps (+2 when W is not a power of two); sends n*log2(p) elements.
    """
    check_args(rank, world, counts=(count,))
    data, snapshot = Region("data", 0, count), Region("scratch", 0, count)
    core, extra = fold(rank, world)
    steps = _fold_in(core, extra, data, segment)
    for tag, distance in enumerate(_powers(world) if core is not None else (), start=1):
        partner = core_rank(core ^ distance, world)
        steps.append(copies(data, snapshot))
        steps.append(sends(partner, snapshot, tag, segment)
                     + recvs(partner, data, tag, segment, reduce=True, first=partner < rank))
    steps += _fold_out(core, extra, data, segment, tag=len(_powers(world)) + 1)
    return finish(steps, scratch=count if core is not None and world > 1 else 0)


def rabenseifner_all_reduce(rank: int, world: int, count: int, *, segment: int = 0) -> Schedule:
    """Recursive-halving reduce-scatter, then recursive-doubling all-gather (Rabenseifner).

    The core of p ranks splits ``data`` into p blocks.  W = 4, blocks 0..3::

        halving   partners      rank keeps (reduces in)    sends away
        step 1    0<->2 1<->3   0: 0-1  1: 0-1  2: 2-3  3: 2-3   the other half
        step 2    0<->1 2<->3   0: 0    1: 1    2: 2    3: 3     the other quarter
        doubling  partners      rank sends its range, stores the partner's
        step 3    0<->1 2<->3   0,1 hold 0-1    2,3 hold 2-3
        step 4    0<->2 1<->3   everyone holds 0-3

    Block b is reduced only by core rank b, then copied, so every rank agrees bit for
    bit.  Non-powers of two fold in and out as in :func:`recursive_doubling_all_reduce`.
    Cost: 2 log2(p) steps (+2 when W is not a power of two);
    sends 2(p-1)/p * n elements per core rank.
    """
    check_args(rank, world, counts=(count,))
    data = Region("data", 0, count)
    core, extra = fold(rank, world)
    steps = _fold_in(core, extra, data, segment)
    p = pow2_floor(world)
    part = blocks("data", split(count, p))

    def half(index: int, size: int) -> Region:
        start = aligned(index, size)
        return span(part[start:start + size])

    rounds = _powers(world) if core is not None else []
    for tag, distance in enumerate(rounds[::-1], start=1):          # recursive halving
        partner = core_rank(core ^ distance, world)
        steps.append(sends(partner, half(core ^ distance, distance), tag, segment)
                     + recvs(partner, half(core, distance), tag, segment, reduce=True))
    for tag, distance in enumerate(rounds, start=len(rounds) + 1):  # recursive doubling
        partner = core_rank(core ^ distance, world)
        steps.append(sends(partner, half(core, distance), tag, segment)
                     + recvs(partner, half(core ^ distance, distance), tag, segment))
    steps += _fold_out(core, extra, data, segment, tag=2 * len(_powers(world)) + 1)
    return finish(steps)


def _powers(world: int) -> list[int]:
    """1, 2, 4, ..., p/2: the partner distances inside the power-of-two core."""
    return [1 << k for k in range(world.bit_length() - 1)]


def _fold_in(core: int | None, extra: int | None, data: Region,
             segment: int) -> list[Step]:
    """The extra (even) rank hands its data to its odd partner, which reduces it in."""
    if extra is None:
        return []
    if core is None:
        return [sends(extra, data, 0, segment)]
    return [recvs(extra, data, 0, segment, reduce=True)]


def _fold_out(core: int | None, extra: int | None, data: Region, segment: int,
              tag: int) -> list[Step]:
    """The odd partner returns the finished result to the extra rank."""
    if extra is None:
        return []
    if core is None:
        return [recvs(extra, data, tag, segment)]
    return [sends(extra, data, tag, segment)]


def two_shot_all_reduce(rank: int, world: int, count: int, *, segment: int = 0) -> Schedule:
    """Direct reduce-scatter, then direct all-gather: every transfer of a phase at once.

    The data is cut into W chunks; rank r owns chunk r.  W = 3, ``xi`` = rank x's chunk i::

        step 1  send chunk j to rank j, receive the others' chunk r into scratch
                rank 0: a1 -> 1, a2 -> 2   <- b0, <- c0
        2..W    reduce the received chunks into the own one, in rank order
                rank 0: a0 = a0 + b0 + c0       (rank 1: b1 = a1 + b1 + c1, ...)
        W+1     send the reduced own chunk to every rank, receive the others'
                rank 0: s0 -> 1, s0 -> 2   <- s1, <- s2

    Only rank r computes chunk r, so every rank ends with identical bits.  Same bytes as
    the ring (2 (W-1)/W n per rank) but 2 latency steps instead of 2 (W-1): the choice
    for medium messages on a host where all W-1 transfers can proceed at once.
    """
    check_args(rank, world, counts=(count,))
    chunks = blocks("data", split(count, world))
    mine = chunks[rank]
    slots = blocks("scratch", [mine.count] * world)  # slot j: chunk `rank` from rank j
    others = [(rank + k) % world for k in range(1, world)]
    scatter = sum((sends(p, chunks[p], 1, segment) + recvs(p, slots[p], 1, segment) for p in others), ())
    reduce = [(Copy(slots[p], mine, reduce=True),) for p in sorted(others) if mine.count]
    gather = sum((sends(p, mine, 2, segment) + recvs(p, chunks[p], 2, segment) for p in others), ())
    return finish([scatter, *reduce, gather], scratch=mine.count * world)
