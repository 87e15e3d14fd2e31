"""Ranks that call different collectives get CollectiveMismatchError, on every rank, fast."""

import time

import numpy as np
import pytest

import chorus as dist
from chorus.testing import run_processes, run_threads


def _mismatched_call(kind, rank):
    x = np.ones(8, np.float32)
    if kind == "op":
        return dist.all_reduce(x) if rank == 0 else dist.broadcast(x, src=0)
    if kind == "dtype":
        return dist.all_reduce(np.ones(8, np.float64) if rank == 1 else x)
    if kind == "count":
        return dist.all_reduce(np.ones(9, np.float32) if rank == 1 else x)
    if kind == "root":
        return dist.broadcast(x, src=1 if rank == 1 else 0)
    if kind == "reduce_op":
        return dist.all_reduce(x, op=dist.ReduceOp.MAX if rank == 2 else dist.ReduceOp.SUM)
    raise AssertionError(kind)


def _body(rank, world, kind):
    """Returns (message, seconds until the error, where it was raised).

    A rank whose part of the mismatched op completed consistently (e.g. it received the
    true root's data in a broadcast where another rank thought itself the root) raises at
    its next call on the group; every other rank raises in the mismatched call itself.
    """
    dist.barrier()
    started = time.monotonic()
    where = "mismatched call"
    try:
        _mismatched_call(kind, rank)
        where = "next call"
        dist.barrier()
    except dist.CollectiveMismatchError as exc:
        message = str(exc)
    else:
        return ("no error", 0.0, where)
    elapsed = time.monotonic() - started
    with pytest.raises(dist.CollectiveMismatchError, match="unusable"):
        dist.barrier()  # the group stays broken after a mismatch
    return (message, elapsed, where)


@pytest.mark.parametrize("kind", ["op", "dtype", "count", "root", "reduce_op"])
def test_mismatch_raises_on_every_rank_within_2s(kind):
    results = run_threads(_body, 4, kind)
    for rank, (message, elapsed, _where) in enumerate(results):
        assert "collective mismatch" in message, (rank, message)
        assert elapsed < 2.0
        assert f"this rank (rank {rank}) called" in message


def test_mismatch_message_names_both_calls():
    message = run_threads(_body, 2, "count")[0][0]
    assert "all_reduce(float32, count=9, op=SUM)" in message or "all_reduce(float32, count=8, op=SUM)" in message
    assert "count=8" in message and "count=9" in message


def test_mismatch_over_tcp_processes():
    results = run_processes(_body, 3, "op")
    assert all("collective mismatch" in m and t < 2.0 for m, t, _ in results), results
