"""How the members' CPUs decide whether a group polls (chorus.shm.placement): ranks pinned to
CPUs of their own poll although each sees one CPU; ranks that share CPUs, and subgroups
(whose non-members may share them), decide as each rank sees it alone."""

import os

import numpy as np
import pytest

import chorus as dist
from chorus import config
from chorus.shm import placement
from chorus.shm.sync import Backoff
from chorus.testing import run_processes

POLLS = config.SETTINGS["CHORUS_SHM_POLLS"].default


def _info(cpu_set, quota=0, beyond=False):
    mask = sum(1 << c for c in cpu_set)
    return mask.to_bytes(placement.MASK_BYTES, "little") + quota.to_bytes(8, "little") + bytes([beyond])


def test_combine_gives_the_cpus_of_members_pinned_apart_and_0_otherwise():
    assert placement.combine([_info({0}), _info({1}), _info({2, 3})]) == 4
    assert placement.combine([_info({0, 1}), _info({2, 3}, quota=1)]) == 1  # the smallest quota caps it
    assert placement.combine([_info({5})]) == 1  # a group of one
    every = range(16)
    assert placement.combine([_info(every), _info(every)]) == 0  # unpinned: each rank's own view decides
    assert placement.combine([_info({0}), _info({0}), _info({1, 2})]) == 0  # two ranks share CPU 0
    assert placement.combine([_info({0, 1}), _info({1, 2})]) == 0
    assert placement.combine([_info({0}), _info(set())]) == 0  # a member only on CPUs from 1024 on
    assert placement.combine([_info({0}), _info({1}, beyond=True)]) == 0  # ... or also on them


def test_this_process_info_describes_its_affinity():
    mine = placement.affinity()
    if max(mine) >= placement.MAX_CPU:
        pytest.skip("CPUs from 1024 on")
    assert placement.combine([placement.info()]) == placement.usable() == min(len(mine), placement.quota() or len(mine))


def test_backoff_counts_the_cpus_it_is_given(monkeypatch):
    monkeypatch.setattr(placement, "usable", lambda: 1)  # a rank pinned to one CPU
    with config.override(CHORUS_SHM_SPIN_US=None, CHORUS_SHM_YIELD_US=None, CHORUS_SHM_POLLS=None):
        assert placement.backoff_for(8, False) == Backoff(spin_s=0.0, yield_s=1e-3)  # alone, it looks oversubscribed
        assert placement.backoff_for(8, False, 8) == Backoff(polls=POLLS)  # with the members' 8 CPUs it is not
        assert placement.backoff_for(8, True, 8) == Backoff(spin_s=0.0, yield_s=1e-3)  # thread ranks never poll


def _pinned_group(rank, world, placement):
    """Pin this rank ("spread": to CPU ``rank``; "one": every rank to the first CPU;
    "pairs": rank r to CPU r % 2), create the world's group again (or, for "pairs", the
    group of ranks 0 and 1), run an all_reduce on it; (polls of its sync, the result)."""
    first = min(os.sched_getaffinity(0))
    cpu = {"spread": first + rank, "one": first, "pairs": first + rank % 2}[placement]
    os.sched_setaffinity(0, {cpu})
    members = [0, 1] if placement == "pairs" else list(range(world))
    g = dist.new_group(members)
    x = np.full(4, rank + 1.0, np.float32)
    if rank in members:
        dist.all_reduce(x, group=g)
    return (g.shm.sync.backoff.polls if rank in members else None), x.tolist()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
                    or min(os.sched_getaffinity(0)) + 1 not in os.sched_getaffinity(0),
                    reason="needs two neighbouring CPUs to pin ranks to")
@pytest.mark.parametrize("placement, world, polls", [("spread", 2, POLLS), ("one", 2, 0), ("pairs", 4, 0)])
def test_ranks_pinned_to_cpus_of_their_own_poll_and_ranks_sharing_cpus_do_not(placement, world, polls,
                                                                              monkeypatch):
    """"pairs": ranks 0 and 1 have a CPU each, but ranks 2 and 3 run on the same two CPUs:
    their group must not poll."""
    for name in ("CHORUS_SHM_SPIN_US", "CHORUS_SHM_YIELD_US", "CHORUS_SHM_POLLS", "CHORUS_TRANSPORT"):
        monkeypatch.delenv(name, raising=False)
    results = run_processes(_pinned_group, world, placement)
    assert [r[1] for r in results[:2]] == [[3.0] * 4] * 2
    assert {r[0] for r in results[:2]} == {polls}
