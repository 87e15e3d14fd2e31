"""Object collectives (chorus/api/objects.py): ranks as threads over the loopback
transport, every root, sub-groups, the torch contracts (in-place lists, return values,
non-members) and the error messages."""

import numpy as np
import pytest

import chorus as dist
from chorus.errors import BufferMismatchError, CollectiveMismatchError, InvalidArgumentError
from chorus.testing import run_processes, run_threads


def obj_of(rank: int):
    """A different object per rank, of a different pickled size per rank."""
    return {"rank": rank, "name": "r" * (rank * 37), "array": np.arange(rank, dtype=np.float32), "t": (rank,)}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


# -- broadcast_object_list -----------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
def test_broadcast_object_list_from_every_root(world):
    def body(rank, w):
        got = []
        for src in range(w):
            objs = ["foo", 12, {1: 2}, obj_of(src)] if rank == src else [None] * 4
            assert dist.broadcast_object_list(objs, src=src) is None
            got.append(objs)
        return got

    for per_rank in run_threads(body, world):
        for src, objs in enumerate(per_rank):
            assert objs[:3] == ["foo", 12, {1: 2}] and same(objs[3], obj_of(src))


def test_broadcast_object_list_keeps_the_list_object_and_the_src_entries():
    marker = object()

    def body(rank, world):
        objs = [marker, "x"] if rank == 0 else [None, None]
        before = objs
        dist.broadcast_object_list(objs, src=0)
        return objs is before, objs[0] is marker

    assert run_threads(body, 2) == [(True, True), (True, False)]


def test_broadcast_object_list_empty_list_is_a_no_op():
    def body(rank, world):
        objs = []
        dist.broadcast_object_list(objs, src=1)
        return objs

    assert run_threads(body, 3) == [[], [], []]


def test_broadcast_object_list_in_a_sub_group_with_src_or_group_src():
    def body(rank, world):
        group = dist.new_group([1, 3])
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            objs = ["untouched"]
            assert dist.broadcast_object_list(objs, src=3, group=group) is None
            return objs
        a = [f"from {rank}"] if rank == 3 else [None]
        dist.broadcast_object_list(a, src=3, group=group)  # src: a global rank
        b = [f"from {rank}"] if rank == 3 else [None]
        dist.broadcast_object_list(b, group=group, group_src=1)  # group rank 1 = global 3
        return a + b

    assert run_threads(body, 4) == [["untouched"], ["from 3", "from 3"], ["untouched"], ["from 3", "from 3"]]


def test_broadcast_object_list_torch_tensors_travel_inside_objects():
    torch = pytest.importorskip("torch")

    def body(rank, world):
        objs = [{"w": torch.arange(6.0).view(2, 3)}] if rank == 0 else [None]
        dist.broadcast_object_list(objs, src=0, device=torch.device("cpu"))
        return objs[0]["w"]

    for t in run_threads(body, 2):
        assert torch.equal(t, torch.arange(6.0).view(2, 3))


def test_broadcast_object_list_different_lengths_name_the_problem():
    def body(rank, world):
        objs = [1, 2, 3] if rank == 0 else [None, None]
        dist.broadcast_object_list(objs, src=0)

    results = run_threads(body, 3, op_timeout=5, return_exceptions=True)
    for rank in (1, 2):
        assert isinstance(results[rank], CollectiveMismatchError)
        assert "broadcast_object_list: object_list must have the same length on every rank" in str(results[rank])
        assert "passed 2 entries" in str(results[rank])


def test_broadcast_object_list_needs_a_list():
    def body(rank, world):
        with pytest.raises(InvalidArgumentError, match="object_list must be a list .*got tuple"):
            dist.broadcast_object_list(("a",), src=0)
        with pytest.raises(InvalidArgumentError, match="src"):
            dist.broadcast_object_list(["a"], src=5)

    run_threads(body, 2)


# -- all_gather_object ---------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 3, 4])
def test_all_gather_object_uneven_sizes(world):
    def body(rank, w):
        out = [None] * w
        assert dist.all_gather_object(out, obj_of(rank)) is None
        return out

    for out in run_threads(body, world):
        assert all(same(out[r], obj_of(r)) for r in range(world))


def test_all_gather_object_the_seed_example():
    """Seed 004, section 6: four ranks, one object each."""
    gather_objects = ["foo", 12, {1: 2}, "xiaodongguaAIGC"]

    def body(rank, world):
        output = [None for _ in gather_objects]
        dist.all_gather_object(output, gather_objects[rank])
        return output

    assert run_threads(body, 4) == [gather_objects] * 4


def test_all_gather_object_in_sub_groups():
    def body(rank, world):
        evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
        group = evens if rank % 2 == 0 else odds
        out = [None, None]
        dist.all_gather_object(out, f"r{rank}", group=group)
        skipped = ["keep"]
        other = odds if rank % 2 == 0 else evens
        assert dist.all_gather_object(skipped, "x", group=other) is None  # not a member: no-op
        return out, skipped

    assert run_threads(body, 4) == [(["r0", "r2"], ["keep"]), (["r1", "r3"], ["keep"]),
                                    (["r0", "r2"], ["keep"]), (["r1", "r3"], ["keep"])]


def test_all_gather_object_wrong_list_length():
    def body(rank, world):
        with pytest.raises(InvalidArgumentError, match=r"object_list must have one entry per rank of the group \(3\), got 2"):
            dist.all_gather_object([None, None], rank)
        with pytest.raises(InvalidArgumentError, match="must be a list"):
            dist.all_gather_object(None, rank)

    run_threads(body, 3)


# -- gather_object -------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
def test_gather_object_to_every_dst(world):
    def body(rank, w):
        got = []
        for dst in range(w):
            out = [None] * w if rank == dst else None
            assert dist.gather_object(obj_of(rank), out, dst=dst) is None
            got.append(out)
        return got

    for rank, per_dst in enumerate(run_threads(body, world)):
        for dst, out in enumerate(per_dst):
            if rank == dst:
                assert all(same(out[r], obj_of(r)) for r in range(world))
            else:
                assert out is None


def test_gather_object_in_a_sub_group_with_group_dst():
    def body(rank, world):
        group = dist.new_group([1, 2, 3])
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            return dist.gather_object("x", None, group=group, group_dst=0)
        out = [None] * 3 if rank == 3 else None  # group rank 2 is global rank 3
        dist.gather_object(rank * 10, out, group=group, group_dst=2)
        return out

    assert run_threads(body, 4) == [None, None, None, [10, 20, 30]]


def test_gather_object_the_list_belongs_to_dst_only():
    def body(rank, world):
        if rank == 0:
            with pytest.raises(InvalidArgumentError, match="object_gather_list must be a list"):
                dist.gather_object("x", None, dst=0)
        else:
            with pytest.raises(InvalidArgumentError, match="object_gather_list must be None on ranks other than dst"):
                dist.gather_object("x", [None, None], dst=0)

    run_threads(body, 2)


def test_gather_object_wrong_list_length_on_dst():
    def body(rank, world):
        with pytest.raises(InvalidArgumentError, match=r"one entry per rank of the group \(1\), got 3"):
            dist.gather_object("x", [None] * 3, dst=0)

    run_threads(body, 1)


# -- scatter_object_list -------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
def test_scatter_object_list_from_every_src(world):
    def body(rank, w):
        got = []
        for src in range(w):
            out = [None]
            ins = [obj_of(r) for r in range(w)] if rank == src else None
            assert dist.scatter_object_list(out, ins, src=src) is None
            got.append(out[0])
        return got

    for rank, per_src in enumerate(run_threads(body, world)):
        assert all(same(obj, obj_of(rank)) for obj in per_src)


def test_scatter_object_list_fills_entry_zero_and_ignores_the_input_off_src():
    def body(rank, world):
        out = [None, "second"]
        dist.scatter_object_list(out, ["a", "bb", "ccc"] if rank == 2 else ["ignored"], src=2)
        return out

    assert run_threads(body, 3) == [["a", "second"], ["bb", "second"], ["ccc", "second"]]


def test_scatter_object_list_in_a_sub_group():
    def body(rank, world):
        group = dist.new_group([0, 2])
        out = ["untouched"]
        dist.scatter_object_list(out, ["to 0", "to 2"] if rank == 2 else None, group=group, group_src=1)
        return out[0]

    assert run_threads(body, 3) == ["to 0", "untouched", "to 2"]


def test_scatter_object_list_errors():
    def body(rank, world):
        with pytest.raises(InvalidArgumentError, match="scatter_object_output_list must be a list of at least one entry"):
            dist.scatter_object_list([], ["a", "b"], src=0)
        if rank == 0:
            with pytest.raises(InvalidArgumentError, match=r"scatter_object_input_list must have one entry per rank of the group \(2\), got 1"):
                dist.scatter_object_list([None], ["a"], src=0)
            with pytest.raises(InvalidArgumentError, match="scatter_object_input_list must be a list"):
                dist.scatter_object_list([None], None, src=0)

    run_threads(body, 2)


# -- send_object_list / recv_object_list -----------------------------------------------------------
def test_send_recv_object_list_returns_the_sender():
    def body(rank, world):
        if rank == 0:
            dist.send_object_list(["foo", 12, {1: 2}], dst=2)
            return None
        if rank == 2:
            objs = [None, None, None]
            sender = dist.recv_object_list(objs, src=0)
            return sender, objs
        return None

    assert run_threads(body, 3)[2] == (0, ["foo", 12, {1: 2}])


def test_recv_object_list_from_any_rank_takes_both_messages_from_one_sender():
    def body(rank, world):
        if rank != 0:
            dist.send_object_list([rank, "x" * 1000 * rank], dst=0)
            return None
        got = {}
        for _ in range(world - 1):
            objs = [None, None]
            sender = dist.recv_object_list(objs)  # src=None: any rank
            got[sender] = objs
        return got

    got = run_threads(body, 4)[0]
    assert got == {r: [r, "x" * 1000 * r] for r in (1, 2, 3)}


def test_send_recv_object_list_in_a_sub_group_with_group_peers():
    def body(rank, world):
        group = dist.new_group([1, 2])
        if rank == 2:
            dist.send_object_list([np.arange(3)], group=group, group_dst=0)
        if rank == 1:
            objs = [None]
            sender = dist.recv_object_list(objs, group=group, group_src=1)
            return sender, objs[0].tolist()
        if rank == 0:
            return dist.recv_object_list([None], group=group, group_src=1)  # not a member
        return None

    results = run_threads(body, 3)
    assert results[1] == (2, [0, 1, 2])  # the sender's global rank, as torch returns
    assert results[0] == -1


def test_send_recv_empty_object_lists():
    def body(rank, world):
        if rank == 0:
            dist.send_object_list([], dst=1)
            dist.send_object_list(["after"], dst=1)
            return None
        first, second = [], [None]
        dist.recv_object_list(first, src=0)
        dist.recv_object_list(second, src=0)
        return first, second

    assert run_threads(body, 2)[1] == ([], ["after"])


def test_recv_object_list_different_lengths_name_the_problem():
    def body(rank, world):
        if rank == 0:
            dist.send_object_list([1, 2, 3], dst=1)
        else:
            dist.recv_object_list([None, None], src=0)

    results = run_threads(body, 2, op_timeout=5, return_exceptions=True)
    assert isinstance(results[1], BufferMismatchError)
    assert "recv_object_list: object_list has 2 entries but the sender sent a different number of objects" in str(
        results[1])


def test_send_object_list_to_itself_is_refused():
    def body(rank, world):
        with pytest.raises(InvalidArgumentError, match="this rank itself"):
            dist.send_object_list(["x"], dst=rank)
        with pytest.raises(InvalidArgumentError, match="must be a list"):
            dist.send_object_list("x", dst=1 - rank)

    run_threads(body, 2)


def test_object_collectives_need_init():
    with pytest.raises(dist.NotInitializedError, match="all_gather_object"):
        dist.all_gather_object([None], 1)


# -- over TCP, in real processes ------------------------------------------------------------------
def _over_tcp(rank, world):
    objs = [obj_of(0), "b"] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    gathered = [None] * world
    dist.all_gather_object(gathered, obj_of(rank))
    if rank == 1:
        dist.send_object_list([{"big": "z" * 300_000}], dst=0)
    elif rank == 0:
        big = [None]
        dist.recv_object_list(big, src=1)
        objs.append(len(big[0]["big"]))
    return objs, gathered


@pytest.mark.slow
def test_object_collectives_over_tcp():
    results = run_processes(_over_tcp, 2)
    for objs, gathered in results:
        assert same(objs[0], obj_of(0)) and objs[1] == "b"
        assert all(same(gathered[r], obj_of(r)) for r in range(2))
    assert results[0][0][2] == 300_000
