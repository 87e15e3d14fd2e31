"""Rooted collectives over a binomial tree, and a pipelined chain broadcast.

The tree (see :mod:`chorus.schedules.chunks`) is drawn in virtual ranks v = rank - root,
so any root works the same way.  For W = 4, root 0::

        0            step 1: 0 -> 2            (broadcast / scatter direction;
       / \\          step 2: 0 -> 1, 2 -> 3     reduce and gather run it backwards)
      2   1
      |
      3

A subtree is a contiguous run of virtual ranks (2 and 3 below 2 above), so gather and
scatter move a whole subtree's blocks as one message; where that run wraps past rank
W-1 in real ranks it is cut there, on both sides, into two messages.
"""

from __future__ import annotations

from chorus.schedules.base import Region, Schedule
from chorus.schedules.chunks import (
    check_args,
    copies,
    cut,
    finish,
    recvs,
    segments,
    sends,
    subtree_size,
    tree_children,
    tree_parent,
    vrank,
    wrap_pieces,
    wrapped_blocks,
)


def binomial_broadcast(rank: int, world: int, count: int, root: int, *,
                       segment: int = 0) -> Schedule:
    """Root's ``data`` to every rank: receive from the parent, then send to each child.

    W = 4, root 0, root's data x::

        step      rank 0     rank 1     rank 2     rank 3
        1         x -> 2     .          x          .
        2         x -> 1     x          x -> 3     x

    Cost: ceil(log2 W) steps on the longest path; the root sends n elements
    ceil(log2 W) times, every other rank receives n once.
    """
    check_args(rank, world, root=root, counts=(count,))
    data, parent = Region("data", 0, count), tree_parent(rank, world, root)
    steps = [recvs(parent, data, 0, segment)] if parent is not None else []
    steps += [sends(child, data, 0, segment) for child in tree_children(rank, world, root)]
    return finish(steps)


def binomial_reduce(rank: int, world: int, count: int, root: int) -> Schedule:
    """op over every rank's ``data`` into the root's ``data``; other ranks' ``data`` stays.

    Children report smallest subtree first.  W = 4, root 0, inputs a b c d::

        round  rank 0               rank 1    rank 2                       rank 3
        1      data = a+b    <- 1   b -> 0    scratch = c, then += d <- 3  d -> 2
        2      data = a+b+cd <- 2   .         scratch = cd -> 0            .

    An inner rank accumulates in ``scratch`` (a Copy of its data first) so its own
    ``data`` is unchanged; only the root reduces in place.
    Cost: ceil(log2 W) steps on the longest path; every rank sends n at most once, the
    root receives and reduces n from each of its ceil(log2 W) children.
    """
    check_args(rank, world, root=root, counts=(count,))
    data, parent = Region("data", 0, count), tree_parent(rank, world, root)
    kids = tree_children(rank, world, root)[::-1]
    acc = data if parent is None or not kids else Region("scratch", 0, count)
    steps = [copies(data, acc)] if acc is not data else []
    steps += [recvs(child, acc, 0, reduce=True) for child in kids]
    if parent is not None:
        steps.append(sends(parent, acc, 0))
    return finish(steps, scratch=acc.count if acc is not data else 0)


def binomial_gather(rank: int, world: int, count: int, root: int) -> Schedule:
    """Every rank's ``input`` into block r of the root's ``output`` (W * count elements).

    W = 4, root 0, inputs a b c d; inner ranks collect their subtree in ``scratch``::

        step      rank 0                  rank 1    rank 2                  rank 3
        1         out[0] = a              b -> 0    scratch[0] = c          d -> 2
                  out[1] <- 1                       scratch[1] <- 3
        2         out[2:4] <- 2                     scratch[0:2] = cd -> 0

    Cost: ceil(log2 W) steps on the longest path; the root receives (W-1) * count
    elements, a rank with a subtree of s ranks sends s * count.
    """
    check_args(rank, world, root=root, counts=(count,))
    parent = tree_parent(rank, world, root)
    kids = tree_children(rank, world, root)[::-1]
    if parent is not None and not kids:  # a leaf sends its input as it is
        return finish([sends(parent, Region("input", 0, count), 0)])
    held = _held(rank, rank, world, root, count, "output")
    steps = [recvs(child, _held(rank, child, world, root, count, "output"), 0)
             for child in kids] or [()]
    steps[0] = copies(Region("input", 0, count), _first_block(held, count)) + steps[0]
    if parent is not None:
        steps.append(sends(parent, held, 0))
    return finish(steps, scratch=0 if parent is None else sum(r.count for r in held))


def binomial_scatter(rank: int, world: int, count: int, root: int) -> Schedule:
    """Block r of the root's ``input`` (W * count elements) into every rank r's ``output``.

    W = 4, root 0, root's input ABCD; inner ranks receive their subtree in ``scratch``::

        step      rank 0                rank 1        rank 2                 rank 3
        1         in[2:4] -> 2          .             scratch[0:2] = CD      .
                  out = A
        2         in[1] -> 1            out = B       scratch[1] = D -> 3    out = D
                                                      out = C

    Cost: ceil(log2 W) steps on the longest path; the root sends (W-1) * count
    elements, a rank with a subtree of s ranks receives s * count.
    """
    check_args(rank, world, root=root, counts=(count,))
    parent = tree_parent(rank, world, root)
    kids = tree_children(rank, world, root)
    if parent is not None and not kids:  # a leaf receives its block straight into output
        return finish([recvs(parent, Region("output", 0, count), 0)])
    held = _held(rank, rank, world, root, count, "input")
    steps = [recvs(parent, held, 0)] if parent is not None else []
    sent = [sends(child, _held(rank, child, world, root, count, "input"), 0)
            for child in kids] or [()]
    sent[0] = copies(_first_block(held, count), Region("output", 0, count)) + sent[0]
    return finish(steps + sent, scratch=0 if parent is None else sum(r.count for r in held))


def chain_broadcast(rank: int, world: int, count: int, root: int, *,
                    segment: int = 0) -> Schedule:
    """Root -> root+1 -> ... -> root-1, the data cut into segments that follow each other
    down the chain like a bucket brigade (pass ``segment`` > 0, else one message).

    W = 4, root 0, segments x0 x1 x2::

        step    rank 0     rank 1               rank 2               rank 3
        0       x0 -> 1    <- x0                .                    .
        1       x1 -> 1    <- x1, x0 -> 2       <- x0                .
        2       x2 -> 1    <- x2, x1 -> 2       <- x1, x0 -> 3       <- x0
        3                  x2 -> 2              <- x2, x1 -> 3       <- x1
        4                                       x2 -> 3              <- x2

    Cost: W + m - 2 steps for m segments on the critical path, each moving n/m elements;
    every rank but the last sends n once.  For large messages: time ~ (W + m - 2) *
    (alpha + beta * n/m), close to n * beta when m >> W.
    """
    check_args(rank, world, root=root, counts=(count,))
    pieces = segments(Region("data", 0, count), segment)
    v = vrank(rank, world, root)
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    lag = 1 if v else 0  # a non-root forwards segment k - 1 while segment k arrives
    steps = []
    for k in range(len(pieces) + lag):
        forward = v + 1 < world and 0 <= k - lag < len(pieces)
        arrive = v > 0 and k < len(pieces)
        steps.append((sends(nxt, pieces[k - lag], 0) if forward else ())
                     + (recvs(prev, pieces[k], 0) if arrive else ()))
    return finish(steps)


def _held(holder: int, rank: int, world: int, root: int, count: int,
          root_buffer: str) -> tuple[Region, ...]:
    """Where ``holder`` keeps the blocks of ``rank``'s subtree, cut where the run of real
    ranks wraps past W-1: the root in ``root_buffer`` at block = real rank, any other
    rank in ``scratch`` in virtual order with its own block first."""
    size = subtree_size(rank, world, root)
    if holder == root:
        return wrapped_blocks(root_buffer, rank, size, world, count)
    start = (vrank(rank, world, root) - vrank(holder, world, root)) * count
    lengths = (n * count for _, n in wrap_pieces(rank, size, world))
    return cut(Region("scratch", start, size * count), lengths)


def _first_block(held: tuple[Region, ...], count: int) -> Region:
    """The holder's own block: the first ``count`` elements of what it holds."""
    return Region(held[0].buffer, held[0].offset, count)
