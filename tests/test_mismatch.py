"""Ranks that call different collectives get CollectiveMismatchError, on every rank, fast:
on threads over the loopback transport and over shared-memory windows (every kind, 4
ranks), and in real processes over TCP and over shared memory (every kind in one job, each
on a group of its own: a mismatch leaves its group unusable)."""

import threading
import time

import numpy as np
import pytest

import chorus as dist
from chorus.testing import run_processes, run_threads

KINDS = ["op", "dtype", "count", "root", "reduce_op"]
TRANSPORTS = {"loopback": "tcp", "shm": "auto"}  # CHORUS_TRANSPORT


def _mismatched_call(kind, rank, group):
    x = np.ones(8, np.float32)
    if kind == "op":
        return dist.all_reduce(x, group=group) if rank == 0 else dist.broadcast(x, src=0, group=group)
    if kind == "dtype":
        return dist.all_reduce(np.ones(8, np.float64) if rank == 1 else x, group=group)
    if kind == "count":
        return dist.all_reduce(np.ones(9, np.float32) if rank == 1 else x, group=group)
    if kind == "root":
        return dist.broadcast(x, src=1 if rank == 1 else 0, group=group)
    if kind == "reduce_op":
        return dist.all_reduce(x, op=dist.ReduceOp.MAX if rank == 2 else dist.ReduceOp.SUM, group=group)
    raise AssertionError(kind)


def _body(rank, world, kind, group=None):
    """Returns (message, seconds until the error, where it was raised).

    A rank whose part of the mismatched op completed consistently (e.g. it received the
    true root's data in a broadcast where another rank thought itself the root) raises at
    its next call on the group; every other rank raises in the mismatched call itself.
    """
    dist.barrier(group=group)
    started = time.monotonic()
    where = "mismatched call"
    try:
        _mismatched_call(kind, rank, group)
        where = "next call"
        dist.barrier(group=group)
    except dist.CollectiveMismatchError as exc:
        message = str(exc)
    else:
        return ("no error", 0.0, where)
    elapsed = time.monotonic() - started
    with pytest.raises(dist.CollectiveMismatchError, match="unusable"):
        dist.barrier(group=group)  # the group stays broken after a mismatch
    return (message, elapsed, where)


def _every_kind(rank, world):
    """Each kind on a group of its own; the world goes on working after all of them."""
    out = {kind: _body(rank, world, kind, dist.new_group(list(range(world)))) for kind in KINDS}
    x = np.ones(2, np.int64)
    dist.all_reduce(x)
    out["world"] = int(x[0])
    return out


def _check(kind, results):
    for rank, (message, elapsed, _where) in enumerate(results):
        assert "collective mismatch" in message, (kind, rank, message)
        assert elapsed < 2.0, (kind, rank, elapsed)
        assert f"this rank (rank {rank}) called" in message, (kind, rank, message)


def _body_then_stay(rank, world, kind, everyone):
    """_body, then stay until every rank has its error: a rank that leaves (destroys its
    group) before another rank's next call has met the mismatch turns that call's error into
    PeerLostError ("rank 3 left the job")."""
    out = _body(rank, world, kind)
    everyone.wait(30)
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", KINDS)
def test_mismatch_raises_on_every_rank_within_2s(kind, transport, monkeypatch):
    monkeypatch.setenv("CHORUS_TRANSPORT", TRANSPORTS[transport])
    _check(kind, run_threads(_body_then_stay, 4, kind, threading.Barrier(4)))


def test_mismatch_message_names_both_calls():
    message = run_threads(_body_then_stay, 2, "count", threading.Barrier(2))[0][0]
    assert "all_reduce(float32, count=9, op=SUM)" in message or "all_reduce(float32, count=8, op=SUM)" in message
    assert "count=8" in message and "count=9" in message


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_mismatch_in_processes(transport, monkeypatch):
    monkeypatch.setenv("CHORUS_TRANSPORT", transport)
    results = run_processes(_every_kind, 3)
    assert [r.pop("world") for r in results] == [3] * 3
    for kind in KINDS:
        _check(kind, [r[kind] for r in results])
