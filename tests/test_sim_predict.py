"""The alpha-beta model: fast for thousands of ranks, and ranking algorithms sensibly."""

from __future__ import annotations

import time

import pytest

from chorus.schedules import ALGORITHMS
from chorus.sim import element_count, predict

ALPHA, BETA = 5e-6, 1 / 10e9


def test_ring_all_reduce_for_4096_ranks_is_fast():
    started = time.process_time()  # CPU time: other processes' load does not count
    seconds = predict("all_reduce", "ring", 4096, 1 << 30)
    assert time.process_time() - started < 1.0
    assert 0.2 < seconds < 0.4  # 8190 alphas + 2 GiB * beta + reductions


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_ring_matches_its_closed_form(world):
    nbytes = world * 1024 * 4
    per_chunk = nbytes / world
    expected = 2 * (world - 1) * (ALPHA + BETA * per_chunk) + (world - 1) * BETA / 4 * per_chunk
    assert predict("all_reduce", "ring", world, nbytes) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("world", [8, 64, 1000])
def test_small_messages_prefer_recursive_doubling_large_ones_ring(world):
    def faster(nbytes):
        ring = predict("all_reduce", "ring", world, nbytes)
        rd = predict("all_reduce", "recursive_doubling", world, nbytes)
        return "ring" if ring < rd else "recursive_doubling"

    assert faster(1024) == "recursive_doubling"
    assert faster(256 << 20) == "ring"


@pytest.mark.parametrize("collective,algorithm",
                         [(c, a) for c, f in ALGORITHMS.items() for a in f if c != "barrier"])
def test_monotonic_in_size(collective, algorithm):
    world = 12
    sizes = [0, 4 * world, 4096 * world, 1 << 20, 1 << 24]
    times = [predict(collective, algorithm, world, n) for n in sizes]
    assert times == sorted(times) and times[-1] > times[0]


def test_root_is_optional_and_counts():
    assert predict("reduce", "binomial", 12, 4096) == predict("reduce", "binomial", 12, 4096,
                                                                root=0)
    assert predict("scatter", "binomial", 12, 4800, root=5) > 0


def test_barrier_costs_log_rounds():
    assert predict("barrier", "dissemination", 9, 0) == pytest.approx(4 * ALPHA)


def test_chain_pipelining_beats_one_big_message_through_the_chain():
    whole = predict("broadcast", "chain", 16, 1 << 26)
    piped = predict("broadcast", "chain", 16, 1 << 26, segment=1 << 18)
    assert piped < whole


def test_element_count():
    assert element_count(4096) == 1024 and element_count(16, itemsize=8) == 2
    with pytest.raises(ValueError, match="whole number"):
        element_count(10, itemsize=4)
