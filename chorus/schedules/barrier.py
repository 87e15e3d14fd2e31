"""Dissemination barrier."""

from __future__ import annotations

from chorus.schedules.base import Recv, Region, Schedule, Send

_TOKEN = Region("token", 0, 0)


def dissemination_barrier(rank: int, world: int) -> Schedule:
    """Every rank learns that every other rank has arrived, in ceil(log2 W) rounds.

    In round k, rank r signals r + 2^k and waits for r - 2^k (mod W)::

        W = 5      round 0 (+1)      round 1 (+2)      round 2 (+4)
                   0 -> 1            0 -> 2            0 -> 4
                   1 -> 2            1 -> 3            1 -> 0
                   ...               ...               ...

    After round k a rank has heard, directly or through others, from the 2^(k+1) - 1
    ranks before it; after ceil(log2 W) rounds from all W - 1.
    Cost: ceil(log2 W) latency steps, zero payload bytes.
    """
    steps = []
    distance, k = 1, 0
    while distance < world:
        steps.append((Send((rank + distance) % world, _TOKEN, tag=k),
                      Recv((rank - distance) % world, _TOKEN, tag=k)))
        distance, k = distance * 2, k + 1
    return Schedule(tuple(steps))
