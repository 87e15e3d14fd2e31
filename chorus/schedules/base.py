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
    with the op's reduction instead of overwriting it: ``dst = op(dst, received)``, or with
    ``first`` ``dst = op(received, dst)``.  Where two ranks compute the same combination
    (a recursive-doubling exchange) the lower rank's operand goes first on both: MIN/MAX
    of -0.0 and 0.0, and numpy's complex product, give other bits with the operands
    swapped."""

    peer: int
    dst: Region
    tag: int = 0
    reduce: bool = False
    first: bool = False


@dataclass(frozen=True, slots=True)
class Copy:
    """Local copy of ``src`` into ``dst`` (same element count); with ``reduce``, combine
    instead: ``dst = op(dst, src)``."""

    src: Region
    dst: Region
    reduce: bool = False


Op = Send | Recv | Copy
Step = tuple[Op, ...]


@dataclass(frozen=True, slots=True)
class Schedule:
    """One rank's part of an algorithm: ``steps`` run in order, the ops inside one step
    concurrently.  ``scratch`` elements of a buffer named ``"scratch"`` (same dtype as the
    data) are provided by whoever runs the schedule.

    Rules every schedule keeps (the simulator checks them):
    * within one step, no region that is sent is also written (by a Recv or a Copy);
    * messages between two ranks with the same tag are received in the order sent.
    """

    steps: tuple[Step, ...]
    scratch: int = 0

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return iter(self.steps)
