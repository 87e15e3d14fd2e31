"""The arithmetic every algorithm shares: blocks, offsets, segments, trees, rings, folds.

Sender and receiver never talk about *where* a piece goes: both compute it with these
functions from (rank, world, count), so they always agree on block boundaries, segment
boundaries and tree shape.  Nothing here touches data; everything counts elements.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from chorus.schedules.base import Copy, Recv, Region, Schedule, Send, Step

# -- splitting a buffer -----------------------------------------------------------------


def split(count: int, parts: int) -> tuple[int, ...]:
    """Sizes of ``parts`` nearly equal blocks of ``count`` elements; the first
    ``count % parts`` blocks get one element more: ``split(10, 4) == (3, 3, 2, 2)``."""
    base, extra = divmod(count, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


def offsets(sizes: Sequence[int]) -> tuple[int, ...]:
    """Where each block starts: ``offsets((3, 3, 2, 2)) == (0, 3, 6, 8)``."""
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += size
    return tuple(out)


def blocks(buffer: str, sizes: Sequence[int], base: int = 0) -> tuple[Region, ...]:
    """Consecutive regions of ``buffer`` with the given sizes, starting at ``base``."""
    return tuple(Region(buffer, base + off, size) for off, size in zip(offsets(sizes), sizes, strict=True))


def span(regions: Sequence[Region]) -> Region:
    """One region covering consecutive regions of one buffer (first to last)."""
    first = regions[0]
    return Region(first.buffer, first.offset, sum(r.count for r in regions))


def cut(region: Region, sizes: Iterable[int]) -> tuple[Region, ...]:
    """``region`` cut into consecutive pieces of the given sizes."""
    return blocks(region.buffer, tuple(sizes), region.offset)


def segments(region: Region, segment: int) -> tuple[Region, ...]:
    """``region`` as pieces of at most ``segment`` elements (``segment <= 0``: one piece).

    An empty region gives no pieces at all, so an empty block costs no message."""
    if region.count == 0:
        return ()
    if segment <= 0 or region.count <= segment:
        return (region,)
    return tuple(Region(region.buffer, start, min(segment, region.offset + region.count - start))
                 for start in range(region.offset, region.offset + region.count, segment))


# -- building ops -----------------------------------------------------------------------


def _pieces(where: Region | Sequence[Region], segment: int) -> tuple[Region, ...]:
    if type(where) is Region:
        return segments(where, segment)
    return tuple(piece for region in where for piece in segments(region, segment))


def _whole(where: Region | Sequence[Region], segment: int) -> bool:
    """True when ``where`` is one non-empty region that goes as one message (the common
    case, kept fast: a ring over 4096 ranks builds 8190 steps)."""
    return type(where) is Region and 0 < where.count and (segment <= 0 or where.count <= segment)


def sends(peer: int, where: Region | Sequence[Region], tag: int,
          segment: int = 0) -> tuple[Send, ...]:
    """Send a region (or several, in order) to ``peer``, one message per segment."""
    if _whole(where, segment):
        return (Send(peer, where, tag),)
    return tuple([Send(peer, piece, tag) for piece in _pieces(where, segment)])


def recvs(peer: int, where: Region | Sequence[Region], tag: int, segment: int = 0,
          reduce: bool = False, first: bool = False) -> tuple[Recv, ...]:
    """Receive into a region (or several) from ``peer``, cut exactly as :func:`sends` cuts
    the matching source, so message k lands in piece k (``reduce``, ``first``: Recv's)."""
    if _whole(where, segment):
        return (Recv(peer, where, tag, reduce, first),)
    return tuple([Recv(peer, piece, tag, reduce, first) for piece in _pieces(where, segment)])


def copies(src: Region, dst: Region) -> tuple[Copy, ...]:
    """A local copy, or nothing when the region is empty."""
    return (Copy(src, dst),) if src.count else ()


def finish(steps: Iterable[Step], scratch: int = 0) -> Schedule:
    """The schedule of ``steps`` without empty steps (a step whose blocks were all empty)."""
    return Schedule(tuple(step for step in steps if step), scratch)


# -- powers of two ----------------------------------------------------------------------


def pow2_floor(n: int) -> int:
    """The largest power of two <= ``n`` (``n >= 1``)."""
    return 1 << (n.bit_length() - 1)


def ceil_log2(n: int) -> int:
    """Rounds needed to double from 1 to at least ``n``: ``ceil(log2 n)``."""
    return (n - 1).bit_length()


def aligned(index: int, size: int) -> int:
    """Start of the ``size``-aligned group (``size`` a power of two) containing ``index``."""
    return index - index % size


# -- binomial tree rooted at ``root`` ----------------------------------------------------
#
# Virtual ranks v = (rank - root) % world put the root at 0.  The parent of v clears its
# lowest set bit; the subtree of v is the contiguous range [v, v + lowbit(v)).
#
#   W = 8:            0
#              /    /    \
#             4    2      1          children of 0: 4, 2, 1 (largest subtree first)
#            / \   |                 children of 4: 6, 5;  of 2: 3;  of 6: 7
#           6   5  3
#           |
#           7


def vrank(rank: int, world: int, root: int) -> int:
    """Rank as seen from ``root`` (the root is 0)."""
    return (rank - root) % world


def real_rank(v: int, world: int, root: int) -> int:
    """Inverse of :func:`vrank`."""
    return (v + root) % world


def _reach(v: int, world: int) -> int:
    """lowbit(v), or a power of two >= world for the root."""
    return v & -v if v else 1 << ceil_log2(world)


def tree_parent(rank: int, world: int, root: int) -> int | None:
    """The rank this rank receives from in a broadcast (None for the root)."""
    v = vrank(rank, world, root)
    return real_rank(v - (v & -v), world, root) if v else None


def tree_children(rank: int, world: int, root: int) -> tuple[int, ...]:
    """The ranks this rank sends to in a broadcast, largest subtree first."""
    v = vrank(rank, world, root)
    bit, kids = _reach(v, world) >> 1, []
    while bit:
        if v + bit < world:
            kids.append(real_rank(v + bit, world, root))
        bit >>= 1
    return tuple(kids)


def subtree_size(rank: int, world: int, root: int) -> int:
    """How many ranks (this one included) hang below ``rank``: [v, v + size) virtually."""
    v = vrank(rank, world, root)
    return min(_reach(v, world), world - v)


def wrap_pieces(first: int, n: int, world: int) -> tuple[tuple[int, int], ...]:
    """Blocks ``first, first+1, ..., first+n-1`` (mod ``world``) as at most two runs
    ``(start, length)`` that do not wrap: ``wrap_pieces(3, 3, 4) == ((3, 1), (0, 2))``."""
    head = min(n, world - first)
    return ((first, head),) if head == n else ((first, head), (0, n - head))


def wrapped_blocks(buffer: str, first: int, n: int, world: int, size: int) -> tuple[Region, ...]:
    """Regions of blocks ``first .. first+n-1`` (mod ``world``) of ``size`` elements each."""
    return tuple(Region(buffer, start * size, length * size)
                 for start, length in wrap_pieces(first, n, world))


# -- ring -------------------------------------------------------------------------------


def ring_pass(rank: int, world: int, send_from: Sequence[Region], recv_into: Sequence[Region],
              *, shift: int, reduce: bool, tag: int, segment: int = 0) -> list[Step]:
    """W - 1 ring steps; in step s rank r sends block (r - s - shift) to r + 1 and receives
    block (r - s - shift - 1) from r - 1 (reducing it in when ``reduce``), tag ``tag + s``.

    Every block is sent once and received once, so ``send_from[b]``/``recv_into[b]`` say
    where block b is read from and written to.  ``shift=1`` is a reduce-scatter that
    leaves rank r with block r complete; ``shift=0`` then circulates block r (all-gather).
    """
    right, left = (rank + 1) % world, (rank - 1) % world
    steps = []
    for s in range(world - 1):
        out, into = (rank - s - shift) % world, (rank - s - shift - 1) % world
        steps.append(sends(right, send_from[out], tag + s, segment)
                     + recvs(left, recv_into[into], tag + s, segment, reduce))
    return steps


# -- folding a non-power-of-two world into a power-of-two core ---------------------------
#
#   W = 6, p = 4, rem = 2:   ranks 0 1 | 2 3 | 4 5
#                            0 -> 1,  2 -> 3 fold in;  core = 1 3 4 5  (core index 0 1 2 3)


def fold(rank: int, world: int) -> tuple[int | None, int | None]:
    """``(core index, extra partner)`` of ``rank`` when the first 2*rem ranks pair up
    (rem = world - pow2_floor(world)): an even one of them gives its data to the odd one
    and sits out (core index None); the odd one stands for both."""
    rem = world - pow2_floor(world)
    if rank >= 2 * rem:
        return rank - rem, None
    return (rank // 2, rank - 1) if rank % 2 else (None, rank + 1)


def core_rank(core: int, world: int) -> int:
    """The rank that plays core index ``core`` (inverse of :func:`fold`)."""
    rem = world - pow2_floor(world)
    return 2 * core + 1 if core < rem else core + rem


# -- arguments --------------------------------------------------------------------------


def check_args(rank: int, world: int, *, root: int | None = None,
               counts: Iterable[int] = ()) -> None:
    """Raise ValueError naming the bad argument (rank, world, root or a count)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the group (0 .. {world - 1})")
    if root is not None and not 0 <= root < world:
        raise ValueError(f"root {root} is outside the group (0 .. {world - 1})")
    for count in counts:
        if count < 0:
            raise ValueError(f"element counts must be >= 0, got {count}")
