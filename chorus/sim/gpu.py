"""Time and bus bandwidth of GPU collectives on a cluster of hosts: NVLink inside each host,
NICs between hosts.  The model behind docs/scale.md.

The cluster (:class:`GpuTopology`)::

    host 0: GPU 0 .. GPU G-1   all-to-all through NVSwitch, nvlink_bandwidth each way per GPU
            NIC 0 .. NIC N-1   nic_bandwidth each way per NIC
    host 1: the same ...       rail l = GPU l of every host, on its share (N/G) of the NICs

Sizes are nccl-tests': ``nbytes`` is the data of all_reduce and broadcast, the whole output
of all_gather and the whole input of reduce_scatter (every rank's).  H hosts, G GPUs per
host, W = H*G GPUs, S = nbytes.

Algorithms, each a list of phases (:class:`Phase`):

    ring          NCCL's ring over all W GPUs, every NIC carrying some of its channels:
                  2(W-1) steps for all_reduce (W-1 for the others), 2(H-1) (H-1) of them
                  across hosts; each GPU and each host send 2(W-1)/W S ((W-1)/W S; S for
                  broadcast, a pipelined chain)
    tree          NCCL's tree, all_reduce only: a chain through the G GPUs of each host, a
                  double binary tree across hosts, reduce going up while broadcast comes
                  down: 2(G-1) NVLink steps and 2 ceil(log2 H) network steps; the busiest GPU
                  sends min(2, G-1) S, the busiest host min(2, H-1) S (two hosts: S each,
                  hence NCCL's busbw above the network's on two hosts)
    hierarchical  chorus's plan, one call per phase:
                  all_reduce      reduce_scatter in the host -> all_reduce of each GPU's
                                  shard on its rail -> all_gather in the host
                  all_gather      all_gather on the rail -> all_gather in the host
                  reduce_scatter  reduce_scatter in the host -> reduce_scatter on the rail
                  broadcast       scatter in the root's host -> broadcast of each shard on
                                  its rail -> all_gather in the host
                  Inside a host chorus reads its peers' memory directly (one step per
                  phase, (G-1)/G S per GPU); on one host the phases are one call.  On the
                  rails (one GPU per host) NCCL picks, and so does the model: ``ring`` or
                  ``tree`` for all_reduce, ``ring`` or ``pat`` (NCCL's logarithmic
                  all_gather/reduce_scatter, which it runs only with one GPU per host) for
                  the others, ``ring`` for broadcast.  ``overlap=True`` lets the phases run
                  chunk by chunk at once: the bytes of all phases share each link, the
                  NVLink and the network ones move at the same time, latencies still add.

A phase costs ``launch_latency`` + its steps' latencies + its bytes at the slower of the
busiest GPU's NVLink and the busiest host's NICs (bytes move in a pipeline, so the two
overlap).  Each phase takes the faster of two protocols, as NCCL does:

    ll      half the bandwidth (a flag travels with every word), the topology's latencies
    simple  full bandwidth, 5x the latencies (NCCL's tuning constants put its Simple
            protocol's step at 5.2 to 5.7 times its LL protocol's)

The H100 defaults (:meth:`GpuTopology.h100`) take NCCL's own tuning constants for the LL
protocol's ring (src/graph/tuning.cc: 6.6 us a call, 0.6 us an NVLink step, 2.7 us a
network step).  Not modelled: NVLink SHARP and IB SHARP (NVLS, CollNet), LL128, the number
of SMs NCCL gives a collective, PCIe between GPU and NIC, congestion and routing.

    >>> t = GpuTopology.h100(hosts=4)
    >>> round(estimate("all_reduce", "ring", t, 1 << 30).busbw / 1e9)  # GB/s
    381
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from chorus.errors import InvalidArgumentError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
ALGORITHMS = ("ring", "tree", "hierarchical")
#: What NCCL may run on a rail (one GPU per host) for each collective.
RAIL_ALGORITHMS = {
    "all_reduce": ("ring", "tree"),
    "all_gather": ("ring", "pat"),
    "reduce_scatter": ("ring", "pat"),
    "broadcast": ("ring",),
}


@dataclass(frozen=True)
class Protocol:
    """How a collective's steps move data: the share of a link's bandwidth it gets, and
    what one step costs as a multiple of the topology's step latency."""

    name: str
    bandwidth_share: float
    latency_scale: float


PROTOCOLS = {p.name: p for p in (Protocol("ll", 0.5, 1.0), Protocol("simple", 1.0, 5.0))}


@dataclass(frozen=True)
class GpuTopology:
    """Hosts of GPUs joined by NVLink inside a host and by NICs between hosts.

    Bandwidths are bytes per second in each direction; latencies are seconds: one step
    across NVLink or across the network, and what launching one call costs."""

    hosts: int
    gpus_per_host: int
    nvlink_bandwidth: float
    nvlink_latency: float
    nics_per_host: int
    nic_bandwidth: float
    nic_latency: float
    launch_latency: float

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("hosts", "gpus_per_host", "nics_per_host"):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise InvalidArgumentError(
                        f"GpuTopology: {f.name} must be a whole number >= 1, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or value < 0 \
                    or (f.name.endswith("bandwidth") and value == 0):
                least = "> 0 (bytes/s)" if f.name.endswith("bandwidth") else ">= 0 (seconds)"
                raise InvalidArgumentError(
                    f"GpuTopology: {f.name} must be a finite number {least}, got {value!r}")

    @classmethod
    def h100(cls, hosts: int, **changes) -> GpuTopology:
        """``hosts`` H100 hosts: 8 GPUs, NVLink 4 at 450 GB/s each way, eight 400 Gb/s NICs;
        NCCL's LL latencies (see the module's docstring).  ``changes`` replace fields."""
        spec = dict(hosts=hosts, gpus_per_host=8, nvlink_bandwidth=450e9, nvlink_latency=0.6e-6,
                    nics_per_host=8, nic_bandwidth=50e9, nic_latency=2.7e-6,
                    launch_latency=6.6e-6)
        return cls(**{**spec, **changes})

    @property
    def gpus(self) -> int:
        return self.hosts * self.gpus_per_host

    @property
    def network_bandwidth(self) -> float:
        """A host's NICs together, each way."""
        return self.nics_per_host * self.nic_bandwidth


@dataclass(frozen=True)
class Phase:
    """One call of an algorithm: its steps across NVLink and across the network, and the
    bytes the busiest GPU sends over NVLink and the busiest host over its NICs."""

    name: str
    nvlink_steps: int = 0
    network_steps: int = 0
    nvlink_bytes: float = 0.0
    network_bytes: float = 0.0

    def latency(self, t: GpuTopology, p: Protocol) -> float:
        steps = self.nvlink_steps * t.nvlink_latency + self.network_steps * t.nic_latency
        return t.launch_latency + p.latency_scale * steps

    def transfer(self, t: GpuTopology, p: Protocol) -> float:
        return max(self.nvlink_bytes / t.nvlink_bandwidth,
                   self.network_bytes / t.network_bandwidth) / p.bandwidth_share

    def seconds(self, t: GpuTopology, p: Protocol) -> float:
        return self.latency(t, p) + self.transfer(t, p)


@dataclass(frozen=True)
class Prediction:
    """The model's answer: seconds, nccl-tests' algbw and busbw (bytes/s), and what each
    phase chose (``name/protocol``)."""

    seconds: float
    algbw: float
    busbw: float
    choices: tuple[str, ...]


def bus_factor(collective: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw for ``collective`` on ``ranks`` ranks."""
    if collective == "all_reduce":
        return 2 * (ranks - 1) / ranks
    return 1.0 if collective == "broadcast" else (ranks - 1) / ranks


def estimate(collective: str, algorithm: str, topology: GpuTopology, nbytes: float, *,
             rail: str | None = None, protocol: str | None = None,
             overlap: bool = False) -> Prediction:
    """Predict one call of ``collective`` (nccl-tests' size ``nbytes``) by ``algorithm``
    on ``topology``.  ``rail`` forces the hierarchical algorithm's rail algorithm and
    ``protocol`` ("ll", "simple") every phase's protocol; by default the fastest is taken.
    ``overlap`` (hierarchical only) runs the phases at once, chunk by chunk."""
    _check_call(collective, algorithm, topology, nbytes, rail, protocol, overlap)
    if algorithm == "hierarchical" and topology.hosts > 1 and rail is None:
        return min((estimate(collective, algorithm, topology, nbytes, rail=r,
                             protocol=protocol, overlap=overlap)
                    for r in RAIL_ALGORITHMS[collective]), key=lambda e: e.seconds)
    phases = _phases(collective, algorithm, topology, nbytes, rail)
    candidates = [PROTOCOLS[protocol]] if protocol else list(PROTOCOLS.values())
    if overlap:  # one protocol for the whole pipeline; phases share the links they use
        moved = Phase("overlapped", nvlink_bytes=sum(ph.nvlink_bytes for ph in phases),
                      network_bytes=sum(ph.network_bytes for ph in phases))

        def whole(p: Protocol) -> float:
            return sum(ph.latency(topology, p) for ph in phases) + moved.transfer(topology, p)
        best = min(candidates, key=whole)
        seconds, chosen = whole(best), [best] * len(phases)
    else:
        chosen = [min(candidates, key=lambda p: ph.seconds(topology, p)) for ph in phases]
        seconds = sum(ph.seconds(topology, p) for ph, p in zip(phases, chosen, strict=True))
    algbw = nbytes / seconds if seconds else 0.0
    return Prediction(seconds, algbw, algbw * bus_factor(collective, topology.gpus),
                      tuple(f"{ph.name}/{p.name}" for ph, p in zip(phases, chosen, strict=True)))


def _check_call(collective, algorithm, t, nbytes, rail, protocol, overlap) -> None:
    where = f"chorus.sim.predict({collective!r}, {algorithm!r}, ...)"
    if collective not in COLLECTIVES:
        raise InvalidArgumentError(f"{where}: the GPU model covers {', '.join(COLLECTIVES)}")
    if algorithm not in ALGORITHMS:
        raise InvalidArgumentError(f"{where}: algorithm must be one of {', '.join(ALGORITHMS)}")
    if algorithm == "tree" and collective != "all_reduce":
        raise InvalidArgumentError(
            f"{where}: NCCL runs its tree for all_reduce only; ask for 'ring' or 'hierarchical'")
    if not isinstance(t, GpuTopology):
        raise InvalidArgumentError(f"{where}: the topology must be a GpuTopology, got {t!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int | float) \
            or not math.isfinite(nbytes) or nbytes < 0:
        raise InvalidArgumentError(f"{where}: nbytes must be a finite number >= 0, got {nbytes!r}")
    if rail is not None and (algorithm != "hierarchical"
                             or rail not in RAIL_ALGORITHMS[collective]):
        raise InvalidArgumentError(
            f"{where}: rail={rail!r} needs algorithm 'hierarchical' and one of "
            f"{', '.join(RAIL_ALGORITHMS[collective])} for {collective}")
    if protocol is not None and protocol not in PROTOCOLS:
        raise InvalidArgumentError(f"{where}: protocol must be one of {', '.join(PROTOCOLS)}")
    if overlap and algorithm != "hierarchical":
        raise InvalidArgumentError(f"{where}: overlap=True is for the hierarchical algorithm")


def _phases(collective: str, algorithm: str, t: GpuTopology, size: float,
            rail: str | None) -> list[Phase]:
    hosts, local, world = t.hosts, t.gpus_per_host, t.gpus
    if world == 1:
        return [Phase(f"{algorithm} on one GPU")]
    if algorithm == "tree":
        return [Phase("tree", 2 * (local - 1), 2 * _log2(hosts),
                      min(2, local - 1) * size, min(2, hosts - 1) * size)]
    rounds = 2 if collective == "all_reduce" else 1
    if algorithm == "ring":
        sent = size if collective == "broadcast" else rounds * (world - 1) / world * size
        return [Phase("ring", rounds * (world - hosts), rounds * (hosts - 1),
                      sent if local > 1 else 0.0, sent if hosts > 1 else 0.0)]
    inside = (local - 1) / local * size  # what each GPU sends in one phase inside its host
    if hosts == 1:
        steps = 1 if collective in ("all_gather", "reduce_scatter") else 2
        return [Phase(f"nvlink {collective}", steps, 0, steps * inside)]
    on_rail = _rail_phase(collective, rail, hosts, size)
    if local == 1:
        return [on_rail]
    first = {"all_reduce": "reduce_scatter", "reduce_scatter": "reduce_scatter",
             "broadcast": "scatter"}
    phases = [on_rail, Phase("nvlink all_gather", 1, 0, inside)]
    if collective == "reduce_scatter":
        phases.pop()
    if collective in first:
        phases.insert(0, Phase(f"nvlink {first[collective]}", 1, 0, inside))
    return phases


def _rail_phase(collective: str, rail: str, hosts: int, size: float) -> Phase:
    """One GPU per host on each rail; every rail carries 1/G of the data, so a host's NICs
    together carry what one rail's GPU would send alone for the whole ``size``."""
    name = f"rail {rail} {collective}"
    if collective == "broadcast":
        return Phase(name, 0, hosts - 1, 0.0, size)
    if collective == "all_reduce" and rail == "tree":
        return Phase(name, 0, 2 * _log2(hosts), 0.0, min(2, hosts - 1) * size)
    rounds = 2 if collective == "all_reduce" else 1
    steps = _log2(hosts) if rail == "pat" else rounds * (hosts - 1)
    return Phase(name, 0, steps, 0.0, rounds * (hosts - 1) / hosts * size)


def _log2(n: int) -> int:
    """ceil(log2 n): the depth of a binary tree over n members."""
    return (n - 1).bit_length()
