"""Groups, rank translation, sub-groups and the torch behaviour for non-members."""

import numpy as np
import pytest

import chorus as dist
from chorus.testing import RankFailed, run_threads


def test_new_group_translates_ranks_and_isolates_traffic():
    def body(rank, world):
        odd = dist.new_group([1, 3])
        even = dist.new_group([0, 2])
        mine = odd if rank % 2 else even
        assert dist.get_world_size(mine) == 2
        assert dist.get_rank(mine) == rank // 2
        assert dist.get_process_group_ranks(mine) == ([1, 3] if rank % 2 else [0, 2])
        other = even if rank % 2 else odd
        assert other is dist.GroupMember.NON_GROUP_MEMBER
        assert dist.get_rank(other) == -1 and dist.get_world_size(other) == -1
        assert dist.send(np.zeros(1), dst=0, group=other) is None  # non-member: no-op
        # group_dst / group_src are ranks within the group; dst / src are global ranks
        buf = np.array([rank], np.int64)
        if dist.get_rank(mine) == 0:
            dist.send(buf, group_dst=1, group=mine)
            dist.recv(buf, src=dist.get_global_rank(mine, 1), group=mine)
        else:
            sender = dist.recv(buf, group_src=0, group=mine)
            assert sender == dist.get_global_rank(mine, 0)  # always the global rank (torch 2.13)
            dist.send(np.array([rank * 10]), dst=dist.get_global_rank(mine, 0), group=mine)
        dist.barrier(group=mine)
        dist.barrier()
        return int(buf[0])

    assert run_threads(body, 4) == [20, 30, 0, 1]


def test_same_tag_in_two_groups_does_not_mix():
    def body(rank, world):
        a = dist.new_group([0, 1])
        b = dist.new_group([0, 1])
        if rank == 0:
            dist.send(np.array([1]), dst=1, group=a)
            dist.send(np.array([2]), dst=1, group=b)
            return None
        x, y = np.zeros(1, np.int64), np.zeros(1, np.int64)
        dist.recv(y, src=0, group=b)  # posted first, must still get group b's message
        dist.recv(x, src=0, group=a)
        return int(x[0]), int(y[0])

    assert run_threads(body, 2)[1] == (1, 2)


def test_group_translation_queries_and_errors():
    def body(rank, world):
        g = dist.new_group([3, 1])
        if rank not in (1, 3):
            return None
        assert dist.get_process_group_ranks(g) == [1, 3]
        assert dist.get_group_rank(g, 3) == 1 and dist.get_global_rank(g, 0) == 1
        with pytest.raises(ValueError, match="not a member"):
            dist.get_group_rank(g, 0)
        with pytest.raises(ValueError, match="valid: 0..1"):
            dist.get_global_rank(g, 2)
        with pytest.raises(ValueError, match="not a member"):
            dist.send(np.zeros(1), dst=0, group=g)
        return True

    assert run_threads(body, 4) == [None, True, None, True]


def test_new_group_rejects_bad_ranks():
    def body(rank, world):
        for ranks, msg in [([0, 7], "outside the world"), ([1, 1], "duplicates"), ([], "empty")]:
            with pytest.raises(ValueError, match=msg):
                dist.new_group(ranks)
        return True

    assert run_threads(body, 2) == [True, True]


def test_new_subgroups_and_by_enumeration():
    def body(rank, world):
        mine, allgroups = dist.new_subgroups(group_size=2)
        assert len(allgroups) == 3 and dist.get_process_group_ranks(mine) == [rank - rank % 2, rank - rank % 2 + 1]
        mine2, all2 = dist.new_subgroups_by_enumeration([[0, 5], [1, 2, 3], [4]])
        expect = {0: [0, 5], 5: [0, 5], 4: [4]}.get(rank, [1, 2, 3])
        assert dist.get_process_group_ranks(mine2) == expect
        dist.barrier(group=mine2)
        with pytest.raises(ValueError, match="divide"):
            dist.new_subgroups(group_size=4)
        with pytest.raises(ValueError, match="more than one subgroup"):
            dist.new_subgroups_by_enumeration([[0, 1], [1, 2]])
        return dist.get_rank(mine)

    assert run_threads(body, 6) == [0, 1, 0, 1, 0, 1]


def test_group_world_and_backend_names():
    def body(rank, world):
        assert dist.group.WORLD is dist.GroupMember.WORLD
        assert dist.group.WORLD.size() == world
        assert dist.is_initialized() and dist.get_backend() == "chorus"
        return True

    assert run_threads(body, 2) == [True, True]
    assert dist.group.WORLD is None and not dist.is_initialized()


def test_barrier_orders_async_ops_and_async_barrier_work():
    def body(rank, world):
        works = [dist.barrier(async_op=True) for _ in range(5)]
        dist.barrier()  # synchronous, queued behind the async ones
        assert all(w.is_completed() for w in works)
        for w in works:
            w.wait()
        return True

    assert run_threads(body, 5) == [True] * 5


def test_unknown_backend_and_bad_timeout():
    with pytest.raises(ValueError, match="unknown backend 'foo'"):
        dist.init_process_group("foo")
    with pytest.raises(ValueError, match="timeout must be positive"):
        dist.init_process_group("gloo", timeout=-1, init_method="tcp://127.0.0.1:1", rank=0, world_size=1)
    with pytest.raises(RankFailed):
        run_threads(lambda r, w: dist.new_subgroups(group_size=0), 2)


def test_split_group_uses_parent_group_ranks():
    def body(rank, world):
        parent = dist.new_group([1, 2, 3, 4, 5])
        if rank == 0:
            return None
        mine = dist.split_group(parent, [[0, 2], [1, 3, 4]])  # group ranks of parent
        return dist.get_process_group_ranks(mine)

    assert run_threads(body, 6) == [None, [1, 3], [2, 4, 5], [1, 3], [2, 4, 5], [2, 4, 5]]


def test_monitored_barrier_names_the_missing_rank():
    import time

    def body(rank, world):
        if rank == 2:
            time.sleep(1.0)  # never calls the barrier in time
            return "slept"
        if rank == 0:
            with pytest.raises(dist.CommTimeoutError, match=r"^Rank 2 failed to pass monitoredBarrier in 300 ms"):
                dist.monitored_barrier(timeout=0.3)
            time.sleep(0.8)  # stay until the others time out (leaving would tell them at once)
            return "reported"
        with pytest.raises(dist.CommTimeoutError,
                           match=f"^Rank {rank} successfully reached monitoredBarrier, .*release the barrier"):
            dist.monitored_barrier(timeout=0.6)
        return "released never"

    assert run_threads(body, 4) == ["reported", "released never", "slept", "released never"]


def test_monitored_barrier_passes_when_all_arrive():
    def body(rank, world):
        for _ in range(3):
            dist.monitored_barrier(timeout=5, wait_all_ranks=True)
        return True

    assert run_threads(body, 4) == [True] * 4


def test_monitored_barrier_speaks_gloos_words_for_all_missing_ranks_and_no_time():
    import threading

    reported = threading.Event()  # the absent ranks stay (a rank that leaves is reported at once)

    def body(rank, world):
        if rank != 0:
            reported.wait(30)
            return None
        try:
            with pytest.raises(dist.CommTimeoutError, match=r"^Ranks 1, 2 failed to pass monitoredBarrier in 200 ms"):
                dist.monitored_barrier(timeout=0.2, wait_all_ranks=True)
            with pytest.raises(dist.CommTimeoutError, match=r"^Rank 0 timed out in monitoredBarrier after 0 ms"):
                dist.monitored_barrier(timeout=0)
        finally:
            reported.set()
        return "reported"

    assert run_threads(body, 3) == ["reported", None, None]
