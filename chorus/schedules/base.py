"""The step language every algorithm is written in.

A schedule is a list of steps; the operations inside one step may run concurrently,
steps run in order.  Peers are *group* ranks; regions name a buffer of the op
(``"input"``, ``"output"``, ``"scratch"``, ...) and count elements, not bytes, so the
same schedule serves every dtype and every transport (including device memory later).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Region:
    """``count`` elements of buffer ``buffer`` starting at element ``offset``."""

    buffer: str
    offset: int
    count: int


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``src`` to group rank ``peer``; ``tag`` tells the op's messages apart."""

    peer: int
    src: Region
    tag: int = 0


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive from group rank ``peer`` into ``dst``; with ``reduce``, combine into ``dst``
    with the op's reduction instead of overwriting it."""

    peer: int
    dst: Region
    tag: int = 0
    reduce: bool = False


@dataclass(frozen=True, slots=True)
class Copy:
    """Local copy of ``src`` into ``dst`` (same element count)."""

    src: Region
    dst: Region


Op = Send | Recv | Copy
Step = tuple[Op, ...]
Schedule = list[Step]
