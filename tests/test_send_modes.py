"""CHORUS_SEND_MODE: buffered sends (the default) return once the data is on its way;
rendezvous sends return once the receiver posted the matching receive, as torch's do, so
ranks that all send first deadlock — and every rank of the cycle gets DeadlockError
naming it, within a bounded time.  Ranks as threads, and one case as processes over TCP."""

import logging
import threading
import time

import numpy as np
import pytest

import chorus as dist
from chorus import config
from chorus.testing import run_processes, run_threads

FIX = "with torch's blocking sends this program hangs"


def _sends_first(rank, world, tag=0):
    """Every rank sends to the next, then receives from the previous (no ordering)."""
    got = np.zeros(4)
    started = time.monotonic()
    try:
        dist.send(np.full(4, float(rank)), dst=(rank + 1) % world, tag=tag)
        dist.recv(got, src=(rank - 1) % world, tag=tag)
    except dist.DeadlockError as exc:
        return time.monotonic() - started, str(exc)
    return time.monotonic() - started, got[0]


def _ordered_ring(rank, world):
    """Even ranks send first, odd ranks receive first (the ring of examples/seeds)."""
    got = np.zeros(4)
    mine = np.full(4, float(rank))
    if rank % 2 == 0:
        dist.send(mine, dst=(rank + 1) % world)
        dist.recv(got, src=(rank - 1) % world)
    else:
        dist.recv(got, src=(rank - 1) % world)
        dist.send(mine, dst=(rank + 1) % world)
    return got[0]


def test_buffered_sends_let_every_rank_send_first():
    assert [value for _, value in run_threads(_sends_first, 3)] == [2.0, 0.0, 1.0]


@pytest.mark.parametrize("world", [2, 3])
def test_rendezvous_sends_first_is_a_deadlock_named_on_every_rank(world):
    with config.override(CHORUS_SEND_MODE="rendezvous"):
        results = run_threads(_sends_first, world, 5)
    for rank, (seconds, message) in enumerate(results):
        assert seconds < 3.0, (rank, seconds)
        waits = [f"rank {r} waits in send to rank {(r + 1) % world} (tag 5)" for r in range(world)]
        mine = waits[rank:] + waits[:rank]
        others = mine[1] if world == 2 else f"{mine[1]} and {mine[2]}"
        assert message.startswith(f"deadlock: {mine[0]} while {others}; {FIX}"), message
        assert "even ranks send first" in message


@pytest.mark.parametrize("world", [3, 4])
def test_rendezvous_ordered_ring_completes(world):
    with config.override(CHORUS_SEND_MODE="rendezvous"):
        assert run_threads(_ordered_ring, world) == [float((r - 1) % world) for r in range(world)]


def test_rendezvous_isend_irecv_posted_together_complete_and_isend_waits_deadlock():
    def body(rank, world):
        peer = 1 - rank
        got = np.zeros(4)
        works = [dist.isend(np.full(4, float(rank)), dst=peer), dist.irecv(got, src=peer)]
        for w in works:
            w.wait()
        batch = dist.batch_isend_irecv([dist.P2POp(dist.isend, np.full(4, 7.0 + rank), peer),
                                        dist.P2POp(dist.irecv, got, peer)])
        for w in batch:
            w.wait()
        assert got[0] == 7.0 + peer
        with pytest.raises(dist.DeadlockError, match=f"rank {rank} waits in send to rank {peer} \\(tag 9\\)"):
            dist.isend(np.ones(4), dst=peer, tag=9).wait()
        return True

    with config.override(CHORUS_SEND_MODE="rendezvous"):
        assert run_threads(body, 2) == [True, True]


def test_rendezvous_send_returns_only_once_the_receive_is_posted(caplog):
    """Rank 1 posts its receive only once rank 0's send has been reported waiting for it
    (the waiting report, an Event): rank 0's send must not have returned by then."""
    caplog.set_level(logging.WARNING, logger="chorus")
    waiting, returned = threading.Event(), threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if "still waiting for rank(s) [1] in send (tag 0)" in record.getMessage():
                waiting.set()

    def body(rank, world):
        if rank == 0:
            dist.send(np.ones(4), dst=1)
            returned.set()
            return None
        assert waiting.wait(20)
        early = returned.is_set()
        dist.recv(np.zeros(4), src=0)
        return early

    handler = Seen()
    logging.getLogger("chorus").addHandler(handler)
    try:
        with config.override(CHORUS_SEND_MODE="rendezvous", CHORUS_WAIT_REPORT_S=0.05):
            assert run_threads(body, 2)[1] is False
    finally:
        logging.getLogger("chorus").removeHandler(handler)


def test_buffered_send_returns_before_the_receive_is_posted():
    returned = threading.Event()

    def body(rank, world):
        if rank == 0:
            dist.send(np.ones(4), dst=1)
            returned.set()
        else:
            assert returned.wait(20)  # would time out if the send waited for this receive
            dist.recv(np.zeros(4), src=0)

    run_threads(body, 2)


def test_rendezvous_send_to_a_rank_that_leaves_without_receiving_fails():
    def body(rank, world):
        if rank == 1:
            dist.barrier()
            dist.destroy_process_group()  # leaves while rank 0's send waits, or before it
            return None
        dist.barrier()
        with pytest.raises(dist.PeerLostError, match="rank 1 left the job"):
            dist.send(np.ones(4), dst=1)
        return True

    with config.override(CHORUS_SEND_MODE="rendezvous"):
        assert run_threads(body, 2)[0] is True


@pytest.mark.slow
def test_rendezvous_deadlock_between_processes(monkeypatch):
    """Two processes over TCP (and, at 4 MiB, the same-host ring) that both send first."""
    monkeypatch.setenv("CHORUS_SEND_MODE", "rendezvous")
    results = run_processes(_big_sends_first, 2, op_timeout=30.0)
    for rank, (seconds, message) in enumerate(results):
        assert seconds < 5.0, (rank, seconds)
        assert message.startswith(f"deadlock: rank {rank} waits in send to rank {1 - rank} (tag 0) while "
                                  f"rank {1 - rank} waits in send to rank {rank} (tag 0); {FIX}"), message


def _big_sends_first(rank, world):
    got = np.zeros(1 << 20, np.float32)
    started = time.monotonic()
    try:
        dist.send(np.ones(1 << 20, np.float32), dst=1 - rank)
        dist.recv(got, src=1 - rank)
    except dist.DeadlockError as exc:
        return time.monotonic() - started, str(exc)
    return time.monotonic() - started, "no deadlock"
