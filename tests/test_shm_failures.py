"""Failures on the shared-memory path, ranks as threads: mismatched calls, a rank that
took the TCP path, a dead rank, a hung rank (timeout), a rank that gave up half-way."""

import dataclasses
import time

import numpy as np
import pytest

import chorus as dist
from chorus.testing import run_threads
from chorus.transport.loopback import LoopbackFabric

pytestmark = pytest.mark.usefixtures("job")  # a job id of its own, no shared-memory file left


def _raises_within(fn, exc, seconds):
    """Run ``fn``; return the message of the ``exc`` it raises, checking it took < ``seconds``."""
    started = time.monotonic()
    with pytest.raises(exc) as info:
        fn()
    elapsed = time.monotonic() - started
    assert elapsed < seconds, (elapsed, str(info.value))
    return str(info.value)


@pytest.mark.parametrize("kind", ["count", "big_vs_small", "op", "algorithm"])
def test_mismatch_raises_on_every_rank_within_2s_naming_both_calls(kind):
    def call(rank):
        x = np.ones(8, np.float32)
        if kind == "count":
            return dist.all_reduce(np.ones(9, np.float32) if rank == 2 else x)
        if kind == "big_vs_small":  # one-shot against reduce-scatter + all-gather
            return dist.all_reduce(np.ones(1 << 20, np.float32) if rank == 2 else x)
        if kind == "op":
            return dist.all_gather_into_tensor(np.ones(32, np.float32), x) if rank == 2 else dist.barrier()
        return dist.all_reduce(x, algorithm="ring" if rank == 2 else None)  # TCP on one rank only

    def body(rank, w):
        assert dist.group.WORLD.shm is not None
        dist.barrier()
        message = _raises_within(lambda: call(rank), dist.CollectiveMismatchError, 2.0)
        with pytest.raises(dist.CollectiveMismatchError, match="unusable"):
            dist.barrier()  # the group stays broken
        return message

    messages = run_threads(body, 4)
    for rank, message in enumerate(messages):
        assert "collective mismatch" in message, (rank, message)
        assert "rank 2" in message, (rank, message)
    if kind == "algorithm":  # the ranks that noticed say why (the others heard it from them)
        assert any("over TCP" in m for m in messages), messages


def test_a_killed_rank_makes_every_survivor_raise_peer_lost_quickly():
    fabric = LoopbackFabric(4)

    def body(rank, w):
        for _ in range(20):
            dist.all_reduce(np.ones(4))
        if rank == 3:
            time.sleep(0.3)  # the others are waiting in the next all_reduce by now
            fabric.kill(3)
            return None
        started = time.monotonic()
        message = _raises_within(lambda: dist.all_reduce(np.ones(4)), dist.PeerLostError, 5.0)
        assert "rank 3" in message
        return time.monotonic() - started

    delays = run_threads(body, 4, fabric=fabric)
    assert all(0.2 < d < 1.5 for d in delays[:3]), delays


def test_a_rank_that_left_is_named_instead_of_waited_for():
    def body(rank, w):
        dist.barrier()
        if rank == 1:
            dist.destroy_process_group()
            return "left"
        return _raises_within(lambda: dist.all_reduce(np.ones(2)), dist.PeerLostError, 2.0)

    results = run_threads(body, 3)
    assert results[1] == "left" and all("rank 1 left" in r for r in results[::2]), results


def test_a_hung_rank_times_out_naming_it_and_the_others_do_not_wait_again():
    def body(rank, w):
        dist.barrier()
        if rank == 1:
            time.sleep(1.5)  # hung past the others' 1 s timeout, then arrives: the others'
            dist.all_reduce(np.ones(2))  # data is still there (they arrived before giving up)
            return _raises_within(lambda: dist.all_reduce(np.ones(2)), dist.AbortedError, 0.5)
        message = _raises_within(lambda: dist.all_reduce(np.ones(2)), dist.CommTimeoutError, 2.5)
        with pytest.raises(dist.AbortedError, match="out of step"):
            dist.all_reduce(np.ones(2))
        return message

    results = run_threads(body, 3, op_timeout=1.0)
    assert "gave up" in results[1]
    for r in results[::2]:
        assert "all_reduce (seq 1)" in r and "[1] did not arrive" in r, r


def test_all_to_all_split_disagreement_is_reported_on_every_rank_and_the_group_goes_on():
    def body(rank, w):
        send = [1, 2] if rank == 0 else [3, 4]
        recv = [1, 3] if rank == 0 else [2, 5]  # rank 1 expects 5 from itself, sends 4
        with pytest.raises(dist.BufferMismatchError, match="group rank 1 sends 4 elements to group rank 1"):
            dist.all_to_all_single(np.zeros(sum(recv)), np.zeros(sum(send)),
                                   output_split_sizes=recv, input_split_sizes=send)
        x = np.full(1, rank)
        dist.all_reduce(x)
        return int(x[0])

    assert run_threads(body, 2) == [1, 1]


def test_ranks_that_each_send_one_count_everywhere_but_different_counts_disagree_on_every_rank():
    """Every rank declares a single count (the one-word fast path), rank 2 another one."""
    def body(rank, w):
        n = 5 if rank == 2 else 4
        with pytest.raises(dist.BufferMismatchError, match="group rank 0 sends 4 elements to group rank 2, which expects 5"):
            dist.all_to_all_single(np.zeros(3 * n), np.zeros(3 * n))
        out = np.zeros(3)
        dist.all_to_all_single(out, np.full(3, float(rank)))  # the group goes on
        return out.tolist()

    assert run_threads(body, 3) == [[0.0, 1.0, 2.0]] * 3


def test_no_false_mismatch_while_a_late_rank_moves_from_one_op_to_the_next():
    """Waiters read late ranks' "current op" words while those ranks change them."""
    def body(rank, w):
        rng = np.random.default_rng(rank)
        a, b = np.ones(3, np.float32), np.ones(5, np.int64)
        for i in range(100):
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.004)  # late: the others wait past a failure check
            dist.all_reduce(a if i % 2 else b, op=dist.ReduceOp.MAX if i % 3 else dist.ReduceOp.SUM)
        return True

    assert all(run_threads(body, 6))


def test_waiters_stop_yielding_when_yields_are_slow(monkeypatch):
    """Next to a busy task a sched_yield() lasts until the task's time slice ends; three
    slow yields in a row make waits sleep instead (chorus.shm.sync)."""
    import threading
    import time

    import chorus.shm.sync as shm_sync

    yields = []
    three = threading.Event()

    def slow_yield():  # a "slow" yield, counted
        time.sleep(2e-4)
        yields.append(threading.get_ident())
        if len(yields) >= 3:
            three.set()

    monkeypatch.setattr(shm_sync.os, "sched_yield", slow_yield)
    monkeypatch.setattr(shm_sync, "SLEEP_ONLY_S", 30.0)  # still sleeping when the test looks
    monkeypatch.setenv("CHORUS_SHM_YIELD_US", str(30_000_000))  # a window of yields no preemption outlasts

    def body(rank, w):
        if rank == 1:
            assert three.wait(30)  # rank 0 waits in the all_reduce, yielding, until then
        dist.all_reduce(np.ones(2))
        return dist.group.WORLD.shm.sync.sleep_only_until - time.monotonic()

    left = run_threads(body, 2)
    assert 0 < left[0] <= shm_sync.SLEEP_ONLY_S  # rank 0 sleeps, not yields, from now on


def test_members_with_other_algorithm_settings_fail_at_init_naming_them(monkeypatch):
    """CHORUS_SHM_ONESHOT_BYTES set on one rank only: its ops would take other algorithms
    (other numbers of syncs) than the others' and fall out of step unseen; the window's
    creation refuses, on every rank, naming the setting."""
    from chorus.api.state import current
    from chorus.shm import handshake

    plain = handshake._settings
    with monkeypatch.context() as patch:
        patch.setattr(handshake, "_settings", lambda s: plain(dataclasses.replace(s, oneshot_bytes=4096))
                      if current().rank == 2 else plain(s))
        errors = run_threads(lambda rank, w: None, 3, return_exceptions=True)
    assert all(isinstance(e, dist.InvalidArgumentError) for e in errors), errors
    assert "rank 2" in str(errors[0]) and "CHORUS_SHM_ONESHOT_BYTES=4096" in str(errors[0])
    assert "rank 2 (this rank)" in str(errors[2]) and "CHORUS_SHM_ONESHOT_BYTES=4096" in str(errors[2])
    assert "another member's shared-memory settings" in str(errors[1])
    assert run_threads(lambda rank, w: dist.group.WORLD.shm is not None, 3) == [True] * 3  # same: fine
