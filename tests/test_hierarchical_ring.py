"""The ring through the hosts (chorus.components.hierarchy, ``CHORUS_HIER_RING_BYTES``) on
simulated hosts: which layouts and sizes take it, the same bits as the flat ring, and the
mismatches between ranks on the ring and ranks in phases (general path, lane, flat ops),
each seen at once on every rank, never failing an earlier op still finishing."""

import collections
import time

import numpy as np
import pytest
from hier_support import LAYOUTS, bits, values

import chorus as dist
from chorus import recorder
from chorus.testing import run_threads

pytestmark = pytest.mark.usefixtures("job")  # a job id of its own, no shared-memory file left

RING_COUNT = (1 << 20) // 4 + 16  # float32 elements: just over CHORUS_HIER_RING_BYTES's 1 MiB


@pytest.mark.parametrize("layout, expected", [("2+2", "ring"), ("1+3", "hierarchical"), ("interleaved", "hierarchical")])
def test_a_large_all_reduce_runs_the_ring_through_hosts_of_two_consecutive_ranks(layout, expected, monkeypatch):
    """From 1 MiB, hosts of at most two consecutive ranks run the flat ring (each host
    entered once); a host of three, or interleaved hosts, keep the phases.  Either way
    every rank gets the flat ring's bits (small integers: every order is exact)."""
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS[layout])
    w = len(LAYOUTS[layout].split(","))
    ways = []

    def listen(e):
        if e.what == "begin" and e.group == 0:
            ways.append((e.component, e.algorithm))

    recorder.attach(listen)
    try:
        def body(rank, w):
            x = values(rank, RING_COUNT, "float32")
            dist.all_reduce(x)
            y = values(rank, RING_COUNT, "float32")
            dist.all_reduce(y, algorithm="ring")
            return bits(x), bits(y)

        results = run_threads(body, w)
    finally:
        recorder.detach()
    expected_sum = sum(values(r, RING_COUNT, "float32") for r in range(w))
    for mine, flat in results:
        assert mine.tobytes() == flat.tobytes() == expected_sum.tobytes()
    assert collections.Counter(ways)[("hierarchical", expected)] == w, ways


def test_the_ring_size_setting_zero_keeps_the_phases(monkeypatch):
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["2+2"])
    monkeypatch.setenv("CHORUS_HIER_RING_BYTES", "0")
    ways = []
    recorder.attach(lambda e: ways.append(e.algorithm) if e.what == "begin" and e.group == 0 else None)
    try:
        results = run_threads(lambda rank, w: dist.all_reduce(np.ones(RING_COUNT, np.float32)) or 0, 4)
    finally:
        recorder.detach()
    assert results == [0] * 4 and ways == ["hierarchical"] * 4


@pytest.mark.parametrize("large, small", [((2, 3), RING_COUNT // 2), ((0,), RING_COUNT // 2),
                                          ((1, 2, 3), RING_COUNT // 2), ((0, 2, 3), 8)],
                         ids=["host-b", "one-rank", "across-hosts", "lane-rank"])
def test_ranks_on_either_side_of_the_ring_size_see_the_mismatch_at_once(monkeypatch, large, small):
    """Ranks ``large`` call an all_reduce of over 1 MiB (the ring on the group), the others
    one of ``small`` elements (512 KiB: the phases on the sub-groups; 8: the two phases on
    the sub-groups' lanes): every rank raises CollectiveMismatchError within seconds, its
    message naming both calls, instead of waiting in different groups."""
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["2+2"])

    def body(rank, w):
        x = np.ones(RING_COUNT if rank in large else small, np.float32)
        dist.barrier()
        started = time.monotonic()
        with pytest.raises(dist.CollectiveMismatchError) as info:
            dist.all_reduce(x)
        return time.monotonic() - started, str(info.value)

    for elapsed, message in run_threads(body, 4, op_timeout=30.0):
        assert elapsed < 5.0, (elapsed, message)
        assert f"count={RING_COUNT}" in message and f"count={small}," in message, message


def test_a_ring_size_below_the_lanes_takes_the_small_all_reduce_off_the_lane(monkeypatch):
    """With CHORUS_HIER_RING_BYTES at 1 KiB, a 4 KiB all_reduce is the ring's on every path:
    a synchronous rank (the lane would run phases) and an async one (the general path) agree."""
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["2+2"])
    monkeypatch.setenv("CHORUS_HIER_RING_BYTES", "1024")

    def body(rank, w):
        x = np.ones(1024, np.float32)
        if rank == 0:
            dist.all_reduce(x, async_op=True).wait()
        else:
            dist.all_reduce(x)
        return x[0]

    assert run_threads(body, 4, op_timeout=20.0) == [4.0] * 4


@pytest.mark.parametrize("flat", ["ring", "all_to_all"])
def test_a_rank_on_a_flat_op_while_the_others_run_phases_fails_every_rank_at_once(monkeypatch, flat):
    """Rank 3 runs a flat op on the group (algorithm="ring", or an all_to_all, which stays
    flat) while the others run a 512 KiB all_reduce in phases: the group sees the mismatch,
    its sub-groups break with it, and nobody waits for the op timeout."""
    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["2+2"])
    n = RING_COUNT // 2

    def body(rank, w):
        x = np.ones(n, np.float32)
        dist.barrier()
        started = time.monotonic()
        with pytest.raises(dist.CollectiveMismatchError):
            if rank != 3:
                dist.all_reduce(x)
            elif flat == "ring":
                dist.all_reduce(x, algorithm="ring")
            else:
                dist.all_to_all_single(np.zeros(n, np.float32), x)
        return time.monotonic() - started

    assert max(run_threads(body, 4, op_timeout=30.0)) < 5.0


def test_a_group_broken_at_a_later_op_spares_the_sub_groups_of_an_earlier_one(monkeypatch):
    """The group breaks at op #1 while rank 1 has run only op #0 (as a rank still finishing
    an earlier op's last phase would): no rank breaks the sub-groups while it is in an op
    before the broken one, and the next op raises the mismatch on every rank."""
    from chorus.components.hierarchy import Hierarchy

    monkeypatch.setenv("CHORUS_HOST_ID", LAYOUTS["2+2"])
    early = []  # sub-groups broken by a rank whose op came before the broken one
    original = Hierarchy._break

    def watched(self, fingerprint):
        at = self.pg.transport.mismatched_at.get(self.pg.id)
        if at is not None and self.current < at:
            early.append((self.pg.rank(), self.current, at))
        original(self, fingerprint)

    monkeypatch.setattr(Hierarchy, "_break", watched)

    def body(rank, w):
        dist.barrier()  # op #0, in phases
        pg = dist.group.WORLD
        if rank == 1:
            pg.transport.group_mismatch(pg.id, 0, 1, 0x1234, 1)  # as if rank 0's frame of op #1 had differed
        started = time.monotonic()
        with pytest.raises(dist.CollectiveMismatchError):
            dist.all_reduce(np.ones(8, np.float32))  # op #1
        return time.monotonic() - started

    assert max(run_threads(body, 4, op_timeout=30.0)) < 5.0
    assert early == []
