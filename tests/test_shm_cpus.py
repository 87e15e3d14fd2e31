"""How the members' CPUs decide whether a group polls (chorus.shm.cpus): ranks pinned to
CPUs of their own poll although each sees one CPU; ranks that share too few CPUs never do."""

import os

import numpy as np
import pytest

import chorus as dist
from chorus.shm import cpus, group
from chorus.shm.sync import Backoff
from chorus.testing import run_processes


def _info(cpu_set, quota=0):
    mask = sum(1 << c for c in cpu_set)
    return mask.to_bytes(cpus.MASK_BYTES, "little") + quota.to_bytes(8, "little")


def test_combine_counts_the_cpus_of_all_members_and_whether_any_two_share_one():
    every = range(16)
    assert cpus.combine([_info(every), _info(every)]) == (16, False)
    assert cpus.combine([_info({0}), _info({1}), _info({2, 3})]) == (4, True)
    assert cpus.combine([_info({0, 1}), _info({1, 2})]) == (3, False)
    assert cpus.combine([_info({0, 1}), _info({0, 1}, quota=1)]) == (1, False)  # the smallest quota caps it
    assert cpus.combine([_info({5})]) == (1, True)  # a group of one
    assert cpus.combine([_info({0}), _info(set())]) is None  # a member on CPUs from 1024 on: unknown


def test_this_process_info_describes_its_affinity():
    mine = cpus.affinity()
    shared, disjoint = cpus.combine([cpus.info()])
    assert disjoint and shared == min(len(mine), cpus.quota() or len(mine))
    assert cpus.usable() == shared


def test_backoff_counts_the_cpus_it_is_given(monkeypatch):
    monkeypatch.setattr(group, "usable_cpus", lambda: 1)  # a rank pinned to one CPU
    for name in ("CHORUS_SHM_SPIN_US", "CHORUS_SHM_YIELD_US"):
        monkeypatch.delenv(name, raising=False)
    assert group.backoff_for(8, False) == Backoff(spin_s=0.0, yield_s=1e-3)  # alone, it looks oversubscribed
    assert group.backoff_for(8, False, 8) == Backoff(polls=group.POLLS)  # with the members' 8 CPUs it is not
    assert group.backoff_for(8, True, 8) == Backoff(spin_s=0.0, yield_s=1e-3)  # thread ranks never poll


def _pinned_group(rank, world, spread):
    """Pin this rank (to CPU ``rank``, or every rank to the first CPU), create a group,
    run an all_reduce on it; (polls of its sync, the result)."""
    first = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {first + rank} if spread else {first})
    g = dist.new_group(list(range(world)))
    x = np.full(4, rank + 1.0, np.float32)
    dist.all_reduce(x, group=g)
    return g.shm.sync.backoff.polls, x.tolist()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
                    or min(os.sched_getaffinity(0)) + 1 not in os.sched_getaffinity(0),
                    reason="needs two neighbouring CPUs to pin ranks to")
@pytest.mark.parametrize("spread", [True, False])
def test_ranks_pinned_to_cpus_of_their_own_poll_and_ranks_on_one_cpu_do_not(spread, monkeypatch):
    for name in ("CHORUS_SHM_SPIN_US", "CHORUS_SHM_YIELD_US", "CHORUS_TRANSPORT"):
        monkeypatch.delenv(name, raising=False)
    results = run_processes(_pinned_group, 2, spread)
    assert [r[1] for r in results] == [[3.0] * 4] * 2
    assert {r[0] for r in results} == ({group.POLLS} if spread else {0})
