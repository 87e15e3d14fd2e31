"""chorus.utils, the seed's distributed.py helpers: in a job (ranks as threads) and
without one (not initialized: rank 0 of 1, every operation returns its input)."""

import numpy as np
import pytest

from chorus import utils
from chorus.errors import InvalidArgumentError, InvalidTensorError
from chorus.testing import run_threads


@pytest.fixture(params=["numpy", "torch"])
def lib(request):
    """Builds arrays of one kind: ``lib(values, dtype)``; ``lib.kind`` names it."""
    if request.param == "numpy":
        def make(values, dtype="float32"):
            return np.array(values, dtype=dtype)
    else:
        torch = pytest.importorskip("torch")

        def make(values, dtype="float32"):
            return torch.tensor(values, dtype=getattr(torch, dtype))
    make.kind = request.param
    return make


def as_list(t):
    return np.asarray(t).tolist()


def is_kind(t, lib) -> bool:
    return isinstance(t, np.ndarray) if lib.kind == "numpy" else type(t).__module__.startswith("torch")


# -- without a job ---------------------------------------------------------------------------
def test_not_distributed_is_rank_0_of_1():
    assert not utils.is_distributed()
    assert (utils.get_rank(), utils.get_world_size(), utils.is_main_process()) == (0, 1, True)
    assert utils.get_device() == "cpu"
    utils.barrier()  # returns at once


def test_not_distributed_operations_return_their_input(lib):
    t = lib([[1.0, 2.0], [3.0, 4.0]])
    assert utils.reduce_tensor(t) is t
    assert utils.reduce_tensor(t, op="sum") is t
    assert utils.broadcast_tensor(t, src=0) is t
    assert utils.all_gather_tensor(t) is t
    gathered = utils.gather_tensor(t, dst=0)
    assert isinstance(gathered, list) and len(gathered) == 1 and gathered[0] is t
    assert as_list(t) == [[1.0, 2.0], [3.0, 4.0]]


def test_reduce_tensor_checks_op_even_without_a_job():
    with pytest.raises(InvalidArgumentError, match='reduce_tensor: op must be "sum" or "mean", got \'max\''):
        utils.reduce_tensor(np.ones(2), op="max")


# -- reduce_tensor ---------------------------------------------------------------------------
def test_reduce_tensor_the_seed_example(lib):
    """Seed 003, 2.2: losses 0.5, 0.3, 0.7, 0.4 -> sum 1.9 and mean 0.475 on every rank."""
    losses = [0.5, 0.3, 0.7, 0.4]

    def body(rank, world):
        loss = lib(losses[rank], "float64")
        total, mean = utils.reduce_tensor(loss, op="sum"), utils.reduce_tensor(loss, op="mean")
        assert is_kind(total, lib) and is_kind(mean, lib)
        return float(loss), float(total), float(mean)

    for rank, (loss, total, mean) in enumerate(run_threads(body, 4)):
        assert loss == losses[rank]  # the input is left alone
        assert total == pytest.approx(1.9) and mean == pytest.approx(0.475)


def test_reduce_tensor_returns_a_new_tensor_of_the_same_shape(lib):
    def body(rank, world):
        t = lib([[rank, 1.0], [2.0, 3.0]])
        out = utils.reduce_tensor(t, op="sum")
        return out is not t, as_list(out), as_list(t)

    for rank, (fresh, out, t) in enumerate(run_threads(body, 3)):
        assert fresh and out == [[3.0, 3.0], [6.0, 9.0]] and t == [[rank, 1.0], [2.0, 3.0]]


def test_reduce_tensor_mean_of_integers_is_a_float(lib):
    def body(rank, world):
        return utils.reduce_tensor(lib([rank, 1], "int64"), op="mean")

    for out in run_threads(body, 4):
        assert as_list(out) == [1.5, 1.0]
        assert "float" in str(out.dtype)


def test_reduce_tensor_of_python_and_numpy_scalars():
    def body(rank, world):
        return utils.reduce_tensor(np.float64(rank)), utils.reduce_tensor(rank, op="sum")

    assert run_threads(body, 3) == [(1.0, 3)] * 3


# -- gather_tensor -----------------------------------------------------------------------------
def test_gather_tensor_the_seed_example(lib):
    """Seed 003, 3.2: predictions of 4 ranks collected on rank 0; None elsewhere."""
    predictions = [[0.8, 0.2, 0.9], [0.1, 0.7, 0.3], [0.6, 0.4, 0.8], [0.2, 0.9, 0.1]]

    def body(rank, world):
        return utils.gather_tensor(lib(predictions[rank]), dst=0)

    results = run_threads(body, 4)
    assert results[1:] == [None, None, None]
    assert all(is_kind(t, lib) for t in results[0])
    assert np.allclose([as_list(t) for t in results[0]], predictions)


@pytest.mark.parametrize("dst", [0, 1, 2])
def test_gather_tensor_to_every_dst(dst, lib):
    def body(rank, world):
        return utils.gather_tensor(lib([[rank, rank + 1]], "int32"), dst=dst)

    results = run_threads(body, 3)
    assert [r for i, r in enumerate(results) if i != dst] == [None, None]
    assert [as_list(t) for t in results[dst]] == [[[0, 1]], [[1, 2]], [[2, 3]]]
    assert all(t.shape == (1, 2) for t in results[dst])


def test_gather_tensor_rejects_non_tensors():
    def body(rank, world):
        with pytest.raises(InvalidTensorError, match="gather_tensor"):
            utils.gather_tensor([1.0, 2.0], dst=0)

    run_threads(body, 2)


# -- broadcast_tensor --------------------------------------------------------------------------
def test_broadcast_tensor_the_seed_example(lib):
    """Seed 003, 4.2: rank 0's [1, 2, 3] reaches everyone, in place."""

    def body(rank, world):
        t = lib([1.0, 2.0, 3.0]) if rank == 0 else lib([0.0, 0.0, 0.0])
        out = utils.broadcast_tensor(t, src=0)
        return out is t, as_list(t)

    assert run_threads(body, 4) == [(True, [1.0, 2.0, 3.0])] * 4


def test_broadcast_tensor_from_another_src_into_a_strided_view():
    def body(rank, world):
        base = np.zeros((3, 4), np.int64)
        view = base[:, 1]  # not contiguous
        if rank == 2:
            view[:] = [7, 8, 9]
        utils.broadcast_tensor(view, src=2)
        return base[:, 1].tolist(), int(base.sum())

    assert run_threads(body, 3) == [([7, 8, 9], 24)] * 3


# -- all_gather_tensor -------------------------------------------------------------------------
def test_all_gather_tensor_uneven_first_dimension(lib):
    def body(rank, world):
        rows = [[10 * rank + i, -(10 * rank + i)] for i in range(rank)]  # rank r has r rows
        t = lib(rows, "int64") if rows else lib(np.zeros((0, 2)), "int64")
        out = utils.all_gather_tensor(t)
        assert is_kind(out, lib) and str(out.dtype).endswith("int64")
        return as_list(out)

    expected = [[10, -10], [20, -20], [21, -21], [30, -30], [31, -31], [32, -32]]
    assert run_threads(body, 4) == [expected] * 4


def test_all_gather_tensor_equal_sizes_and_more_dimensions(lib):
    def body(rank, world):
        t = lib(np.full((2, 2, 3), rank), "float32")
        return utils.all_gather_tensor(t)

    for out in run_threads(body, 3):
        assert tuple(out.shape) == (6, 2, 3)
        assert as_list(out[:, 0, 0]) == [0, 0, 1, 1, 2, 2]


def test_all_gather_tensor_of_0d_tensors_stacks_them(lib):
    def body(rank, world):
        return as_list(utils.all_gather_tensor(lib(rank * 1.5)))

    assert run_threads(body, 3) == [[0.0, 1.5, 3.0]] * 3


def test_all_gather_tensor_everybody_empty():
    def body(rank, world):
        out = utils.all_gather_tensor(np.zeros((0, 5), np.float32))
        return out.shape, out.dtype

    assert run_threads(body, 2) == [((0, 5), np.float32)] * 2


def test_all_gather_tensor_with_a_single_rank_returns_a_copy():
    def body(rank, world):
        t = np.arange(4).reshape(2, 2)
        out = utils.all_gather_tensor(t)
        return out is not t and out.tolist() == t.tolist()

    assert run_threads(body, 1) == [True]


@pytest.mark.parametrize("case, what", [
    ("shape", "shape after the first dimension"),
    ("dtype", "dtype"),
    ("ndim", "number of dimensions"),
])
def test_all_gather_tensor_disagreements_fail_on_every_rank(case, what):
    def body(rank, world):
        t = np.zeros((2, 3), np.float32)
        if rank == 1:
            t = {"shape": np.zeros((2, 4), np.float32), "dtype": np.zeros((2, 3), np.float64),
                 "ndim": np.zeros((2, 3, 1), np.float32)}[case]
        with pytest.raises(InvalidArgumentError, match=f"ranks \\[1\\] pass a tensor whose {what} differs"):
            utils.all_gather_tensor(t)

    run_threads(body, 3)


def test_all_gather_tensor_error_message_shows_this_ranks_shape():
    def body(rank, world):
        cols = 3 if rank == 0 else 2
        with pytest.raises(InvalidArgumentError, match=rf"this rank: shape \(n, {cols}\), dtype float32"):
            utils.all_gather_tensor(np.zeros((1, cols), np.float32))

    run_threads(body, 2)


def test_all_gather_tensor_rejects_non_tensors():
    def body(rank, world):
        with pytest.raises(InvalidTensorError, match="all_gather_tensor"):
            utils.all_gather_tensor([[1, 2]])

    run_threads(body, 2)


# -- the rank helpers inside a job -------------------------------------------------------------
def test_rank_helpers_in_a_job():
    def body(rank, world):
        utils.barrier()
        return (utils.is_distributed(), utils.get_rank(), utils.get_world_size(), utils.is_main_process())

    assert run_threads(body, 3) == [(True, 0, 3, True), (True, 1, 3, False), (True, 2, 3, False)]
