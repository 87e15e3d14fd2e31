"""The GPU cluster model (chorus.sim.gpu): its arithmetic against hand-computed cases, its
shape (monotonic, the right algorithm winning where it must), and its errors."""

from __future__ import annotations

import dataclasses
import doctest
import importlib.util
import itertools
import math
import os

import pytest

from chorus.errors import InvalidArgumentError
from chorus.sim import GpuTopology, estimate, predict
from chorus.sim.gpu import COLLECTIVES, PROTOCOLS

MIB = 1 << 20
# round numbers, so the expected times below can be worked out by hand
LINKS = dict(nvlink_bandwidth=100e9, nvlink_latency=1e-6, nic_bandwidth=10e9, nic_latency=3e-6,
             launch_latency=5e-6)
LL, SIMPLE = PROTOCOLS["ll"], PROTOCOLS["simple"]


def cluster(hosts: int, gpus: int, nics: int | None = None) -> GpuTopology:
    return GpuTopology(hosts=hosts, gpus_per_host=gpus, nics_per_host=nics or gpus, **LINKS)


@pytest.mark.parametrize("protocol", ["ll", "simple"])
def test_one_host_ring_is_the_nvlink_ring(protocol):
    p = PROTOCOLS[protocol]
    got = estimate("all_reduce", "ring", cluster(1, 4), MIB, protocol=protocol).seconds
    # 2(G-1) = 6 NVLink steps; every GPU sends 2(G-1)/G = 1.5 x the data over NVLink
    want = 5e-6 + p.latency_scale * 6 * 1e-6 + 1.5 * MIB / (p.bandwidth_share * 100e9)
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("protocol", ["ll", "simple"])
def test_two_hosts_of_one_gpu_is_the_network_ring(protocol):
    p = PROTOCOLS[protocol]
    got = estimate("all_reduce", "ring", cluster(2, 1, nics=2), MIB, protocol=protocol).seconds
    # 2 steps across the network; 2(W-1)/W = 1 x the data through the host's 2 NICs
    want = 5e-6 + p.latency_scale * 2 * 3e-6 + MIB / (p.bandwidth_share * 2 * 10e9)
    assert got == pytest.approx(want, rel=1e-12)


def test_ring_across_hosts_counts_network_steps_and_the_slower_link():
    # 2 hosts x 4 GPUs: 14 steps, 2 of them across hosts; 1.75 x the data on each GPU's
    # NVLink (100 GB/s) and on each host's NICs (4 x 10 GB/s): the NICs are slower
    got = estimate("all_reduce", "ring", cluster(2, 4), MIB, protocol="simple").seconds
    want = 5e-6 + 5 * (12 * 1e-6 + 2 * 3e-6) + 1.75 * MIB / 40e9
    assert got == pytest.approx(want, rel=1e-12)


def test_tree_hand_computed():
    # 4 hosts x 4 GPUs: 2(G-1) = 6 NVLink steps, 2 log2(4) = 4 network steps; the busiest
    # GPU sends 2 x the data over NVLink, the busiest host 2 x over its NICs
    got = estimate("all_reduce", "tree", cluster(4, 4), MIB, protocol="ll").seconds
    want = 5e-6 + 6 * 1e-6 + 4 * 3e-6 + max(2 * MIB / 100e9, 2 * MIB / 40e9) / 0.5
    assert got == pytest.approx(want, rel=1e-12)


def test_hierarchical_all_reduce_hand_computed():
    t, n = cluster(2, 4), 8 * MIB
    inside = 5e-6 + 5 * 1e-6 + 0.75 * n / 100e9          # (G-1)/G of the data over NVLink
    rail = 5e-6 + 5 * 2 * 3e-6 + 1.0 * n / 40e9           # ring of 2 hosts: 2(H-1)/H = 1
    got = estimate("all_reduce", "hierarchical", t, n, rail="ring", protocol="simple")
    assert got.seconds == pytest.approx(inside + rail + inside, rel=1e-12)
    assert got.choices == ("nvlink reduce_scatter/simple", "rail ring all_reduce/simple",
                           "nvlink all_gather/simple")
    overlapped = estimate("all_reduce", "hierarchical", t, n, rail="ring", protocol="simple",
                          overlap=True).seconds
    latencies = 3 * 5e-6 + 5 * (1e-6 + 2 * 3e-6 + 1e-6)
    assert overlapped == pytest.approx(latencies + max(1.5 * n / 100e9, n / 40e9), rel=1e-12)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_hierarchical_with_one_gpu_per_host_is_the_ring(collective):
    t = cluster(8, 1, nics=2)
    for n in (8, MIB, 1 << 30):
        hier = estimate(collective, "hierarchical", t, n, rail="ring").seconds
        assert hier == pytest.approx(estimate(collective, "ring", t, n).seconds, rel=1e-12)


def test_default_takes_the_fastest_protocol_and_rail():
    t = GpuTopology.h100(hosts=16)
    for n in (8, 64 << 10, 16 * MIB, 1 << 30):
        ring = [estimate("all_reduce", "ring", t, n, protocol=p).seconds for p in PROTOCOLS]
        assert estimate("all_reduce", "ring", t, n).seconds == min(ring)
        # each phase of the hierarchy takes its own protocol: no worse than any forced one
        forced = [estimate("all_reduce", "hierarchical", t, n, rail=r, protocol=p).seconds
                  for r, p in itertools.product(("ring", "tree"), PROTOCOLS)]
        rails = [estimate("all_reduce", "hierarchical", t, n, rail=r).seconds
                 for r in ("ring", "tree")]
        best = estimate("all_reduce", "hierarchical", t, n).seconds
        assert best == min(rails) <= min(forced)


def test_bus_bandwidth_is_nccl_tests_factor_times_algbw():
    t = GpuTopology.h100(hosts=4)
    e = estimate("all_reduce", "ring", t, 1 << 30)
    assert e.algbw == pytest.approx((1 << 30) / e.seconds)
    assert e.busbw == pytest.approx(e.algbw * 2 * 31 / 32)
    assert estimate("broadcast", "ring", t, 1 << 30).busbw == pytest.approx(
        estimate("broadcast", "ring", t, 1 << 30).algbw)


def test_predict_takes_a_topology_in_place_of_the_world_size():
    t = GpuTopology.h100(hosts=2)
    assert predict("all_gather", "hierarchical", t, MIB, overlap=True) == \
        estimate("all_gather", "hierarchical", t, MIB, overlap=True).seconds
    with pytest.raises(InvalidArgumentError, match="alpha belong to the flat model"):
        predict("all_reduce", "ring", t, MIB, alpha=1e-6)


@pytest.mark.parametrize("hosts,gpus", [(1, 8), (2, 8), (64, 8), (5, 3), (16, 1)])
def test_time_grows_with_size(hosts, gpus):
    t = cluster(hosts, gpus)
    sizes = [0, 8, 1000, 64 << 10, MIB, 16 * MIB, 1 << 30, 16 << 30]
    for collective in COLLECTIVES:
        for algorithm, options in (("ring", {}), ("tree", {}), ("hierarchical", {}),
                                   ("hierarchical", {"overlap": True})):
            if algorithm == "tree" and collective != "all_reduce":
                continue
            times = [estimate(collective, algorithm, t, n, **options).seconds for n in sizes]
            assert times == sorted(times) and times[-1] > times[0], (collective, algorithm)


def test_faster_links_never_slow_anything_down():
    slow, n = GpuTopology.h100(hosts=8), 64 * MIB
    for change in (dict(nvlink_bandwidth=900e9), dict(nic_bandwidth=100e9),
                   dict(nvlink_latency=0.1e-6), dict(nic_latency=1e-6)):
        fast = GpuTopology.h100(hosts=8, **change)
        for collective in COLLECTIVES:
            assert estimate(collective, "ring", fast, n).seconds <= \
                estimate(collective, "ring", slow, n).seconds
            assert estimate(collective, "hierarchical", fast, n).seconds <= \
                estimate(collective, "hierarchical", slow, n).seconds


def test_small_messages_at_scale_ring_linear_tree_logarithmic():
    ring = [estimate("all_reduce", "ring", GpuTopology.h100(hosts=h), 8).seconds for h in (64, 128)]
    tree = [estimate("all_reduce", "tree", GpuTopology.h100(hosts=h), 8).seconds for h in (64, 128)]
    # doubling the hosts adds 2 network steps to the tree and doubles the ring's steps
    assert tree[1] - tree[0] == pytest.approx(2 * 2.7e-6)
    assert ring[1] / ring[0] == pytest.approx(2, rel=0.01)


def test_two_host_tree_beats_the_network_bound_beyond_two_it_does_not():
    # the busiest host sends the data once on 2 hosts, twice from 3 on, while busbw counts
    # 2(W-1)/W of it: on 2 hosts of 4 GPUs busbw passes the NICs' 40 GB/s
    two = estimate("all_reduce", "tree", cluster(2, 4), 1 << 30)
    four = estimate("all_reduce", "tree", cluster(4, 4), 1 << 30)
    assert two.busbw > 40e9 > four.busbw


@pytest.mark.parametrize("field,value", [
    ("hosts", 0), ("hosts", 1.5), ("hosts", True), ("gpus_per_host", -1), ("nics_per_host", 0),
    ("nvlink_bandwidth", 0), ("nic_bandwidth", -5e9), ("nic_bandwidth", math.inf),
    ("nvlink_latency", -1e-6), ("nic_latency", math.nan), ("launch_latency", "6us"),
])
def test_bad_topology_names_the_field(field, value):
    with pytest.raises(InvalidArgumentError, match=f"GpuTopology: {field} must be"):
        dataclasses.replace(GpuTopology.h100(hosts=2), **{field: value})


@pytest.mark.parametrize("args,kwargs,message", [
    (("all_gather", "tree"), {}, "tree for all_reduce only; ask for 'ring' or 'hierarchical'"),
    (("all_to_all", "ring"), {}, "covers all_reduce, all_gather"),
    (("all_reduce", "rabenseifner"), {}, "one of ring, tree, hierarchical"),
    (("all_reduce", "hierarchical"), {"rail": "pat"}, "one of ring, tree for all_reduce"),
    (("broadcast", "hierarchical"), {"rail": "tree"}, "one of ring for broadcast"),
    (("all_reduce", "ring"), {"rail": "ring"}, "needs algorithm 'hierarchical'"),
    (("all_reduce", "ring"), {"overlap": True}, "overlap=True is for the hierarchical"),
    (("all_reduce", "ring"), {"protocol": "ll128"}, "protocol must be one of ll, simple"),
])
def test_bad_calls_say_what_to_ask_for(args, kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        estimate(*args, GpuTopology.h100(hosts=2), MIB, **kwargs)


@pytest.mark.parametrize("nbytes", [-1, math.nan, "1M"])
def test_bad_size(nbytes):
    with pytest.raises(InvalidArgumentError, match="nbytes must be a finite number >= 0"):
        estimate("all_reduce", "ring", GpuTopology.h100(hosts=2), nbytes)


def test_docstring_examples_hold():
    import chorus.sim
    import chorus.sim.gpu
    for module in (chorus.sim, chorus.sim.gpu):
        assert doctest.testmod(module).failed == 0, module.__name__


def test_scale_page_and_its_result_file_are_up_to_date():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("predict_scale",
                                                  os.path.join(root, "tools", "predict_scale.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--check"]) == 0, "run: PYTHONPATH=$PWD python3 tools/predict_scale.py"
