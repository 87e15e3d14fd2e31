"""Algorithms as pure functions that return schedules (see DESIGN.md, "The schedule model")."""

from chorus.schedules.all_gather import bruck_all_gather, ring_all_gather
from chorus.schedules.all_reduce import (
    rabenseifner_all_reduce,
    recursive_doubling_all_reduce,
    ring_all_reduce,
)
from chorus.schedules.all_to_all import bruck_all_to_all, pairwise_all_to_all
from chorus.schedules.barrier import dissemination_barrier
from chorus.schedules.base import Copy, Recv, Region, Schedule, Send, Step
from chorus.schedules.reduce_scatter import pairwise_reduce_scatter, ring_reduce_scatter
from chorus.schedules.registry import ALGORITHMS, algorithm, schedule
from chorus.schedules.tree import (
    binomial_broadcast,
    binomial_gather,
    binomial_reduce,
    binomial_scatter,
    chain_broadcast,
)

__all__ = [
    "ALGORITHMS", "Copy", "Recv", "Region", "Schedule", "Send", "Step", "algorithm",
    "binomial_broadcast", "binomial_gather", "binomial_reduce", "binomial_scatter",
    "bruck_all_gather", "bruck_all_to_all", "chain_broadcast", "dissemination_barrier",
    "pairwise_all_to_all", "pairwise_reduce_scatter", "rabenseifner_all_reduce",
    "recursive_doubling_all_reduce", "ring_all_gather", "ring_all_reduce",
    "ring_reduce_scatter", "schedule",
]
