"""Ranks that call different collectives get CollectiveMismatchError, on every rank, fast:
on threads over the loopback transport and over shared-memory windows (every kind, 4
ranks), and in real processes over TCP and over shared memory (every kind in one job, each
on a group of its own: a mismatch leaves its group unusable).  Every rank's message names
each distinct call and the ranks that made it."""

import threading
import time

import numpy as np
import pytest

import chorus as dist
from chorus.testing import run_processes, run_threads
from chorus.transport.base import MISMATCH_SETTLE_S
from chorus.wire.fingerprint import describe_calls, fingerprint, ranks_text

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


#: The calls every rank's message names, with the ranks that made each (op #1: the
#: barrier before it is op #0).  Ranks 0-3; one call per clause, by lowest rank.
CALLS = {
    "op": "rank 0 called all_reduce(float32, count=8, op=SUM) as op #1; "
          "ranks [1-3] called broadcast(float32, count=8, root=0) as op #1",
    "dtype": "ranks [0, 2, 3] called all_reduce(float32, count=8, op=SUM) as op #1; "
             "rank 1 called all_reduce(float64, count=8, op=SUM) as op #1",
    "count": "ranks [0, 2, 3] called all_reduce(float32, count=8, op=SUM) as op #1; "
             "rank 1 called all_reduce(float32, count=9, op=SUM) as op #1",
    "root": "ranks [0, 2, 3] called broadcast(float32, count=8, root=0) as op #1; "
            "rank 1 called broadcast(float32, count=8, root=1) as op #1",
    "reduce_op": "ranks [0, 1, 3] called all_reduce(float32, count=8, op=SUM) as op #1; "
                 "rank 2 called all_reduce(float32, count=8, op=MAX) as op #1",
}


def _check(kind, results, world=4):
    """Every rank raised within 2 s, naming itself and the same calls with their ranks."""
    calls = CALLS[kind] if world == 4 else CALLS[kind].replace("ranks [1-3]", "ranks [1, 2]").replace(
        "ranks [0, 2, 3]", "ranks [0, 2]").replace("ranks [0, 1, 3]", "ranks [0, 1]")
    for rank, (message, elapsed, _where) in enumerate(results):
        assert message.startswith("collective mismatch on group"), (kind, rank, message)
        assert elapsed < 2.0, (kind, rank, elapsed)
        assert f"(this rank is rank {rank}): {calls}. The group is unusable" in message, (kind, rank, message)


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


def test_mismatch_message_names_both_calls_and_who_made_each():
    messages = [m for m, _, _ in run_threads(_body_then_stay, 2, "count", threading.Barrier(2))]
    for rank, message in enumerate(messages):
        assert (f"(this rank is rank {rank}): rank 0 called all_reduce(float32, count=8, op=SUM) as op #1; "
                "rank 1 called all_reduce(float32, count=9, op=SUM) as op #1. ") in message, message


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_mismatch_in_processes(transport, monkeypatch):
    monkeypatch.setenv("CHORUS_TRANSPORT", transport)
    results = run_processes(_every_kind, 3)
    assert [r.pop("world") for r in results] == [3] * 3
    for kind in KINDS:
        _check(kind, [r[kind] for r in results], world=3)


def test_calls_are_described_one_clause_per_call_with_the_ranks_that_made_it():
    a = fingerprint("all_reduce", "float32", 1024, -1, "SUM")
    b = fingerprint("broadcast", "float32", 1024, 0)
    text = describe_calls({0: (1, a), 2: (1, a), 1: (1, b), 5: (2, b)}, range(8))
    assert text == ("ranks [0, 2] called all_reduce(float32, count=1024, op=SUM) as op #1; "
                    "rank 1 called broadcast(float32, count=1024, root=0) as op #1; "
                    "rank 5 called broadcast(float32, count=1024, root=0) as op #2; ranks [3, 4, 6, 7]: not known")
    assert ranks_text([0, 1, 2, 3, 5, 7, 8]) == "ranks [0-3, 5, 7, 8]"


def test_a_member_that_never_reaches_the_op_is_named_as_not_known_after_a_second(monkeypatch):
    """Ranks 0 and 1 disagree on the count; rank 2 stays out of the group's ops until
    they have raised: they wait at most MISMATCH_SETTLE_S for its call, then name it.
    (Between threads: over shared memory the first sync waits for every rank.)"""
    monkeypatch.setenv("CHORUS_TRANSPORT", "tcp")
    both_raised = threading.Barrier(3)

    def body(rank, world):
        dist.barrier()
        if rank == 2:
            both_raised.wait(30)
            return None
        started = time.monotonic()
        with pytest.raises(dist.CollectiveMismatchError) as info:
            dist.all_reduce(np.ones(8 + rank, np.float32))
        elapsed = time.monotonic() - started
        both_raised.wait(30)
        return str(info.value), elapsed

    for rank, (message, elapsed) in enumerate(run_threads(body, 3)[:2]):
        assert (f"(this rank is rank {rank}): rank 0 called all_reduce(float32, count=8, op=SUM) as op #1; "
                "rank 1 called all_reduce(float32, count=9, op=SUM) as op #1; rank 2: not known.") in message, message
        assert MISMATCH_SETTLE_S - 0.1 < elapsed < MISMATCH_SETTLE_S + 1.0, elapsed


_A = fingerprint("all_reduce", "float32", 8, -1, "SUM")


def _messages_after_report(known: int, report: tuple) -> list[str]:
    """Four ranks that know the same call of ranks 0..known-1 (all_reduce of 8 float32, op
    #1); rank 0 then gets ``report`` (culprit, seq, fingerprint, detector) and passes it
    on; every rank's mismatch message."""
    told = threading.Barrier(4)

    def body(rank, world):
        t = dist.group.WORLD.transport
        t.note_calls(0, {r: (1, _A) for r in range(known)})
        if rank == 0:
            t.group_mismatch(0, *report)
        told.wait()
        return str(t.mismatch_error(0, None))

    return run_threads(body, 4)


def test_a_rank_told_of_equal_calls_run_different_ways_names_who_saw_whom():
    """Equal calls, one rank on another path: a rank that only heard of the mismatch (it
    knows the calls, not the paths) names the rank that ran it another way, as reported."""
    messages = _messages_after_report(4, (2, 1, _A, 3))  # rank 3's report: rank 2 ran op #1 another way
    for rank, message in enumerate(messages):  # rank 0 passed the report on: it names rank 3
        assert ("ranks [0-3] called all_reduce(float32, count=8, op=SUM) as op #1: the same call, run different "
                "ways (rank 3 found rank 2 running it another way; algorithm=") in message, (rank, message)


def test_a_rank_that_knows_some_calls_names_the_reported_rank():
    """Settled before every call is known (a loaded host): the report that broke the group
    still names the rank found not to match, and by whom."""
    message = _messages_after_report(3, (2, 1, _A, 1))[0]  # rank 3's call: not known
    assert ("ranks [0-2] called all_reduce(float32, count=8, op=SUM) as op #1; rank 3: not known; "
            "rank 1 found that rank 2's call does not match its own.") in message, message


def test_a_report_of_another_call_than_the_one_known_is_named_as_reported():
    """The first word about a rank stands in the calls; a later report that it called
    something else is quoted, not turned into "run different ways"."""
    message = _messages_after_report(4, (2, 2, fingerprint("broadcast", "float32", 8, 0), 3))[0]
    assert ("ranks [0-3] called all_reduce(float32, count=8, op=SUM) as op #1; rank 3 found rank 2 calling "
            "broadcast(float32, count=8, root=0) as op #2.") in message, message
    assert "run different ways" not in message
