"""Which algorithm a collective uses, per call.

Order of precedence:
1. ``algorithm=`` passed to the call (chorus-only keyword);
2. the group's setting ``CHORUS_ALGO_<COLLECTIVE>=<name>``, e.g. ``CHORUS_ALGO_ALL_REDUCE=ring``
   (read when the group is created, chorus.config; passed in as ``forced``);
3. the default rule below, by message size (bytes per rank) and world size.

Default rules (thresholds from per-algorithm sweeps over TCP at W = 4: each algorithm
forced with ``CHORUS_ALGO_<COLLECTIVE>`` under ``chorus bench --transport tcp``):

    collective      rule
    all_reduce      <= 32 KiB, or W >= 8 and <= 256 KiB: recursive_doubling;
                    W = 4 and >= 8 MiB, or >= 16 MiB: ring; else rabenseifner
    broadcast       < 1 MiB or W <= 2: binomial; else chain (pipelined)
    reduce          binomial
    all_gather      <= 32 KiB per rank: bruck; else ring
    gather/scatter  binomial
    reduce_scatter  uneven counts: pairwise; else ring
    all_to_all      W <= 16: linear (everything in flight at once); else uniform and
                    <= 4 KiB per block: bruck; else pairwise
    barrier         dissemination

A group whose members span hosts, with several members on some host, has a hierarchy
(chorus.components.hierarchy): its all_reduce, reduce, broadcast, all_gather, reduce_scatter and
barrier run ``hierarchical`` by default (shared memory inside each host, the rules above
between one leader per host; an all_reduce of at least ``CHORUS_HIER_RING_BYTES`` on hosts
of at most two consecutive ranks: the ring through the hosts); naming a TCP algorithm above runs the
flat one instead.
``hierarchical`` on a group with nothing to split (one host, or one rank per host) means
no preference: the group's default (shared memory on one host, else the environment and
the rules above).
"""

from __future__ import annotations

from chorus.errors import InvalidArgumentError
from chorus.schedules.registry import ALGORITHMS

KIB, MIB = 1 << 10, 1 << 20
HIERARCHICAL = "hierarchical"
#: every collective the components run (the API's variants map onto these)
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter",
               "all_to_all", "barrier")
#: the collectives with a hierarchical algorithm (chorus.components.hierarchy)
HIERARCHICAL_COLLECTIVES = frozenset({"all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter",
                                      "barrier"})


def default_algorithm(collective: str, world: int, nbytes: int, uniform: bool = True) -> str:
    """The built-in rule for ``collective`` moving ``nbytes`` per rank among ``world`` ranks."""
    if collective == "all_reduce":
        if nbytes <= 32 * KIB or (world >= 8 and nbytes <= 256 * KIB):
            return "recursive_doubling"
        # rabenseifner: 2 log2(W) steps, each a single exchange that the waiting thread reads
        # itself (chorus.transport.tcp_receive), against ring's 2 (W - 1) and two_shot's
        # W - 1 transfers at once per phase.  Same-job sweeps, 2-vCPU VM, median us
        # (ring / rabenseifner / two_shot): W=3 1 MiB 3917 / 3012 / 4008; W=4 1 MiB
        # 6139 / 4349 / 6930, 16 MiB 44890 / 41462 / 53504; W=8 1 MiB 18096 / 12308 / 17965,
        # 4 MiB 36718 / 27841 / 38259; W=2 16 MiB 16038 / 12732 (ring).  Where every rank
        # has a core (16-vCPU VM, docs/results/16-vcpu-xeon/tcp-ring-16m/, ring against
        # rabenseifner, us, two runs): 16 MiB W=4 11866, 12457 against 19236, 16346 (gloo
        # 12260-13028), W=2 10790, 9998 against 11593, 10487; 4 MiB level or rabenseifner
        # ahead (W=2 2404, 2370 against 2185, 1990).  So ring from 16 MiB: its pipeline
        # keeps sending, receiving and reducing at once, which the 2-vCPU VM's four ranks
        # could not.  At W = 4 ring leads from 8 MiB on the 16-vCPU host (two runs, three
        # rounds each, docs/results/16-vcpu-h200-host/tcp-large/: 8 MiB 4237 and 5006 us
        # against rabenseifner's 5713 and 5843, gloo 4735-5346; level at 4 MiB).
        if nbytes >= 16 * MIB or (world == 4 and nbytes >= 8 * MIB):
            return "ring"
        return "rabenseifner"
    if collective == "broadcast":
        return "binomial" if nbytes < MIB or world <= 2 else "chain"
    if collective == "all_gather":
        return "bruck" if nbytes <= 32 * KIB else "ring"
    if collective == "reduce_scatter":
        return "ring" if uniform else "pairwise"
    if collective == "all_to_all":
        if world <= 16:
            return "linear"
        return "bruck" if uniform and nbytes <= 4 * KIB else "pairwise"
    if collective == "barrier":
        return "dissemination"
    return "binomial"  # reduce, gather, scatter


def choose(collective: str, world: int, nbytes: int, requested: str | None = None,
           uniform: bool = True, forced: str | None = None) -> str:
    """Resolve the algorithm for one call (``requested``: the call's ``algorithm=``;
    ``forced``: the group's ``CHORUS_ALGO_<COLLECTIVE>``); InvalidArgumentError lists the
    valid names."""
    name = requested or forced or None
    if name is None or (name == HIERARCHICAL and collective in HIERARCHICAL_COLLECTIVES):
        return default_algorithm(collective, world, nbytes, uniform)  # nothing to split here
    valid = ALGORITHMS[collective]
    if name not in valid:
        source = "algorithm=" if requested else f"CHORUS_ALGO_{collective.upper()}"
        raise InvalidArgumentError(
            f"{collective}: unknown algorithm {name!r} (from {source}); valid: {', '.join(valid_names(collective))}")
    if name == "bruck" and collective == "all_to_all" and not uniform:
        raise InvalidArgumentError("all_to_all: algorithm 'bruck' needs equal split sizes; use 'pairwise'")
    return name


def valid_names(collective: str) -> list[str]:
    """Every algorithm name ``collective`` accepts, sorted."""
    extra = [HIERARCHICAL] if collective in HIERARCHICAL_COLLECTIVES else []
    return sorted([*ALGORITHMS[collective], *extra])


def without_hierarchy(collective: str, requested: str | None) -> str | None:
    """``requested`` for a group with no hierarchy: ``hierarchical`` becomes None (the
    group's default, shared memory on one host); anything else is unchanged."""
    if requested == HIERARCHICAL and collective in HIERARCHICAL_COLLECTIVES:
        return None
    return requested
