"""all_to_all_single's latency path (chorus.shm.group.ShmGroup.all_to_all_fast): the same
results as the general path for every dtype and shape, ranks on either path in one op,
counts that disagree (every rank raises, the group stays usable), counts that send other
ranks more than a round, N-D arrays that go on with single copy, and the calls it leaves
to the general path.  Ranks are threads, each with its own mapping of the window."""

import numpy as np
import pytest

import chorus as dist
from chorus.shm import direct
from chorus.testing import run_threads


def _spy_exchange(monkeypatch) -> list:
    """Count the ops that take all_to_all_single's latency path."""
    from chorus.shm.group import ShmGroup

    calls = []
    plain = ShmGroup.all_to_all_fast
    monkeypatch.setattr(ShmGroup, "all_to_all_fast", lambda self, *a: (calls.append(self.group), plain(self, *a))[1])
    return calls


def _a2a_expected(make, rank, w):
    """What rank ``rank`` receives when every rank q sends ``make(q)`` in W equal blocks."""
    return np.concatenate([np.array_split(make(q), w)[rank] for q in range(w)])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_to_all_single_takes_the_cached_plan_and_matches_the_general_path(world, monkeypatch):
    calls = _spy_exchange(monkeypatch)
    cases = [("float32", (world * 5,)), ("int64", (world * 2, 3)), ("float16", (world,)), ("bool", (world * 7,)),
             ("complex64", (world * 4, 2)), ("uint8", (world * 1000,))]

    def make(rank, dtype, shape):
        i = np.arange(int(np.prod(shape))) + 7 * rank
        v = i % 3 == 0 if dtype == "bool" else (i % 11 - 5) * (1 + 1j * (i % 2)) if dtype == "complex64" else i % 251
        return np.asarray(v).astype(dtype).reshape(shape)

    def body(rank, w):
        same = []
        for dtype, shape in cases:
            fast_out, general_out = np.zeros(shape, dtype), np.zeros(shape, dtype)
            for _ in range(3):  # the plan, then the cached plan
                dist.all_to_all_single(fast_out, make(rank, dtype, shape))
            dist.all_to_all_single(general_out, make(rank, dtype, shape), async_op=True).wait()  # general path
            want = _a2a_expected(lambda q, d=dtype, s=shape: make(q, d, s).reshape(-1), rank, w).reshape(shape)
            same.append((dtype, np.array_equal(fast_out, general_out), np.array_equal(fast_out, want)))
        return same

    for same in run_threads(body, world):
        assert same == [(dtype, True, True) for dtype, _ in cases]
    assert len(calls) == world * 3 * len(cases)


def test_all_to_all_single_ranks_on_either_path_agree(monkeypatch):
    """One rank takes the latency path while the others take the general path (a strided
    input, a torch tensor, an in-place call): the same words are published, results agree."""
    torch = pytest.importorskip("torch")
    calls = _spy_exchange(monkeypatch)

    def body(rank, w):
        n = 6 * w
        mine = np.arange(n, dtype=np.float32) + 100 * rank
        out = np.zeros(n, np.float32)
        if rank == 0:
            dist.all_to_all_single(out, mine)  # latency path
        elif rank == 1:
            dist.all_to_all_single(out, np.repeat(mine, 2)[::2])  # strided input: general path
        elif rank == 2:
            dist.all_to_all_single(torch.from_numpy(out), torch.from_numpy(mine))  # tensors: general path
        else:
            out[...] = mine
            dist.all_to_all_single(out, out)  # in place: general path
        return out

    outs = run_threads(body, 4)
    for rank, out in enumerate(outs):
        assert np.array_equal(out, _a2a_expected(lambda q: np.arange(24, dtype=np.float32) + 100 * q, rank, 4))
    assert calls == [calls[0]]  # rank 0 only


def test_all_to_all_single_latency_path_reports_counts_that_disagree_on_every_rank():
    """A rank on the latency path (equal blocks) with a peer that sends it another count:
    every rank raises the general path's error at the same sync, and the group stays usable."""
    def body(rank, w):
        if rank == 0:
            call = lambda: dist.all_to_all_single(np.zeros(4, np.float32), np.ones(4, np.float32))  # noqa: E731
        else:
            call = lambda: dist.all_to_all_single(np.zeros(4, np.float32), np.ones(4, np.float32),  # noqa: E731
                                                  output_split_sizes=[2, 2], input_split_sizes=[3, 1])
        with pytest.raises(dist.BufferMismatchError, match="sends 3 elements to group rank 0, which expects 2"):
            call()
        out = np.zeros(4, np.float32)
        dist.all_to_all_single(out, np.full(4, rank, np.float32))
        return out.tolist()

    assert run_threads(body, 2) == [[0, 0, 1, 1]] * 2


def test_all_to_all_single_latency_path_goes_on_when_the_other_ranks_send_each_other_other_counts(monkeypatch):
    """Rank 0 sends and receives 2 elements to and from everyone (latency path); rank 1
    sends rank 2 more than a round holds: the counts agree, and rank 0 continues on the
    general path's rest, through the second round's sync."""
    calls = _spy_exchange(monkeypatch)
    big = 50_000  # > a piece of a 1 MiB slot: 131072 int64 / 3 ranks
    splits = {0: ([2, 2, 2], [2, 2, 2]), 1: ([2, 1, big], [2, 1, 3]), 2: ([2, 3, 3], [2, big, 3])}

    def body(rank, w):
        send, recv = splits[rank]
        inp = np.arange(sum(send), dtype=np.int64) + 100 * rank
        out = np.zeros(sum(recv), np.int64)
        if rank == 0:
            dist.all_to_all_single(out, inp)
        else:
            dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
        return out.tolist()

    outs = run_threads(body, 3)

    def block(q, r):
        send = splits[q][0]
        start = sum(send[:r])
        return list(range(100 * q + start, 100 * q + start + send[r]))

    for r, out in enumerate(outs):
        assert out == block(0, r) + block(1, r) + block(2, r)
    assert len(calls) == 1


def test_all_to_all_single_latency_path_is_left_to_the_general_path_when_it_does_not_apply(monkeypatch):
    calls = _spy_exchange(monkeypatch)

    def body(rank, w):
        x = np.arange(8, dtype=np.float32) + 10 * rank
        dist.all_to_all_single(np.zeros(8, np.float64), x.astype(np.float64))  # plan: float64 (8,)
        dist.all_to_all_single(np.zeros(8, np.float32), x)  # plan: float32 (8,)
        with pytest.raises(dist.InvalidArgumentError, match="one dtype"):
            dist.all_to_all_single(np.zeros(8, np.float64), x)  # dtypes differ: the general path raises
        return True

    assert run_threads(body, 2) == [True, True]
    assert len(calls) == 4

    calls.clear()

    def body2(rank, w):
        x = np.arange(8, dtype=np.float32) + 10 * rank
        read_only = np.zeros(8, np.float32)
        read_only.flags.writeable = False
        with pytest.raises(dist.InvalidArgumentError, match="read-only"):
            dist.all_to_all_single(read_only, x)
        with pytest.raises(dist.InvalidArgumentError, match="not divisible by world_size"):
            dist.all_to_all_single(np.zeros(7, np.float32), x[:7])
        threshold = direct.cma_bytes(dist.group.WORLD.shm.window, "all_to_all")
        big = np.zeros(threshold // 4 * 2 // w * w, np.float32)
        dist.all_to_all_single(big.copy(), big)  # too large for one round: general path
        return True

    assert run_threads(body2, 2) == [True, True]
    assert calls == []


def test_all_to_all_single_latency_path_with_nd_arrays_goes_on_with_single_copy(monkeypatch):
    """Rank 1 (latency path, 2-D arrays) and rank 0 (splits that send itself more than
    single copy's threshold): the counts agree, the op continues with single copy, and
    rank 1's rows arrive where they belong."""
    calls = _spy_exchange(monkeypatch)

    def body(rank, w):
        big = direct.cma_bytes(dist.group.WORLD.shm.window, "all_to_all") // 8
        if rank == 0:
            inp = np.arange(big + 3, dtype=np.int64)
            out = np.full(big + 3, -1, np.int64)
            dist.all_to_all_single(out, inp, output_split_sizes=[big, 3], input_split_sizes=[big, 3])
            return out[big:].tolist(), bool(np.array_equal(out[:big], inp[:big]))
        inp = np.arange(6, dtype=np.int64).reshape(2, 3) + 100
        out = np.full((2, 3), -1, np.int64)
        dist.all_to_all_single(out, inp)
        return out.tolist(), big

    first, (second, big) = run_threads(body, 2)
    assert first == ([100, 101, 102], True)
    assert second == [[big, big + 1, big + 2], [103, 104, 105]]
    assert len(calls) == 1
