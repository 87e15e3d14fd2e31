"""Every algorithm by collective and name, with one calling convention per collective.

=============== =========================================== ==============================
collective      algorithms                                  arguments after (rank, world)
=============== =========================================== ==============================
all_reduce      ring, recursive_doubling, rabenseifner      count, *, segment=0
broadcast       binomial, chain                             count, root, *, segment=0
reduce          binomial                                    count, root
all_gather      ring, bruck                                 count
gather          binomial                                    count, root
scatter         binomial                                    count, root
reduce_scatter  ring, pairwise                              counts
all_to_all      pairwise, bruck                             send_counts, recv_counts
barrier         dissemination                               (none)
=============== =========================================== ==============================
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from chorus.schedules.all_gather import bruck_all_gather, ring_all_gather
from chorus.schedules.all_reduce import (
    rabenseifner_all_reduce,
    recursive_doubling_all_reduce,
    ring_all_reduce,
    two_shot_all_reduce,
)
from chorus.schedules.all_to_all import bruck_all_to_all, linear_all_to_all, pairwise_all_to_all
from chorus.schedules.barrier import dissemination_barrier
from chorus.schedules.base import Schedule
from chorus.schedules.reduce_scatter import pairwise_reduce_scatter, ring_reduce_scatter
from chorus.schedules.tree import (
    binomial_broadcast,
    binomial_gather,
    binomial_reduce,
    binomial_scatter,
    chain_broadcast,
)

ALGORITHMS: dict[str, dict[str, Callable[..., Schedule]]] = {
    "all_reduce": {
        "ring": ring_all_reduce,
        "recursive_doubling": recursive_doubling_all_reduce,
        "rabenseifner": rabenseifner_all_reduce,
        "two_shot": two_shot_all_reduce,
    },
    "broadcast": {"binomial": binomial_broadcast, "chain": chain_broadcast},
    "reduce": {"binomial": binomial_reduce},
    "all_gather": {"ring": ring_all_gather, "bruck": bruck_all_gather},
    "gather": {"binomial": binomial_gather},
    "scatter": {"binomial": binomial_scatter},
    "reduce_scatter": {"ring": ring_reduce_scatter, "pairwise": pairwise_reduce_scatter},
    "all_to_all": {"pairwise": pairwise_all_to_all, "bruck": bruck_all_to_all,
                   "linear": linear_all_to_all},
    "barrier": {"dissemination": dissemination_barrier},
}


def algorithm(collective: str, name: str) -> Callable[..., Schedule]:
    """The function for ``name``; ValueError listing the valid names if there is none."""
    family = ALGORITHMS.get(collective)
    if family is None:
        raise ValueError(f"unknown collective {collective!r}; "
                         f"valid collectives: {', '.join(sorted(ALGORITHMS))}")
    fn = family.get(name)
    if fn is None:
        raise ValueError(f"unknown {collective} algorithm {name!r}; "
                         f"valid algorithms: {', '.join(sorted(family))}")
    return fn


@functools.lru_cache(maxsize=4096)
def schedule(collective: str, name: str, rank: int, world: int, **kwargs) -> Schedule:
    """Rank ``rank``'s schedule of ``collective`` by algorithm ``name``, e.g.
    ``schedule("all_reduce", "ring", 0, 4, count=1024)``.

    Schedules are immutable, so repeated calls with the same arguments (a training loop)
    reuse one object; keyword arguments must be hashable (tuples, not lists)."""
    return algorithm(collective, name)(rank, world, **kwargs)
