"""Sync's first-sync fast path (``arrive_first``) against a control area written by hand:
it finishes the sync only when every other rank arrived at it and began the same op, and
otherwise leaves the waiting and the checking to ``settle_first``.  Each such test runs
with the tokens in the control lines (groups of more than 8 ranks) and with the arrival
blocks (``packed``: groups of 6 to 8)."""

import sys
import time

import numpy as np
import pytest

from chorus import config
from chorus.engine import OpContext
from chorus.errors import CollectiveMismatchError, CommTimeoutError
from chorus.shm import placement
from chorus.shm import sync as shm_sync
from chorus.shm.sync import ARRIVED, OP, WORDS, Backoff, Sync, token
from chorus.wire.fingerprint import describe_calls, fingerprint

FP = fingerprint("all_reduce", "float32", 4, -1, "SUM")
OTHER_FP = fingerprint("all_reduce", "float32", 5, -1, "SUM")


class _Transport:
    """What Sync asks of a transport: nothing failed; mismatches are recorded."""

    def __init__(self):
        self.dead, self.left, self.mismatches = set(), set(), []

    def failure(self, group, peer, expect=None):
        return None

    def group_mismatch(self, group, culprit, seq, fp, detector):
        self.mismatches.append((culprit, seq, fp))

    def note_calls(self, group, calls):
        self.calls = calls

    def mismatch_error(self, group, expect, why=None):
        return CollectiveMismatchError(describe_calls(self.calls))


def _syncs(world: int, polls: int, packed: bool = False):
    control = memoryview(np.zeros(world * WORDS, np.uint64)).cast("B").cast("Q")
    arrivals = memoryview(np.zeros(32, np.uint64)).cast("B") if packed else None
    transport = _Transport()
    return [Sync(control, r, tuple(range(world)), transport, 0, Backoff(polls=polls), None, arrivals)
            for r in range(world)], control


def _begun(sync: Sync, seq: int, fp: int, arrived: bool) -> None:
    """Rank ``sync.rank`` began op ``seq`` and, if ``arrived``, reached its first sync
    (its counter, and its word of the parity's arrival block where there is one)."""
    sync.begin(seq, fp)
    if arrived:
        sync.count += 1
        sync.control[sync.mine + ARRIVED] = sync.count
        if sync._blocks is not None:
            sync._arrivals[sync._arrival_word[(sync.count - 1) & 1]] = sync.count


def _ctx(seq: int, fp: int, timeout: float) -> OpContext:
    return OpContext("all_reduce", 0, seq, fp, (0, 1, 2), time.monotonic() + timeout)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("polls", [0, 50])
def test_arrive_first_finishes_only_when_every_rank_began_the_same_op(polls, packed):
    syncs, _ = _syncs(3, polls, packed)
    for s in syncs[1:]:
        _begun(s, 0, FP, arrived=True)
    syncs[0].begin(0, FP)
    assert syncs[0].arrive_first(0, FP)
    assert syncs[0].count == 1


@pytest.mark.parametrize("packed", [False, True])
def test_arrive_first_leaves_a_missing_rank_to_settle_first_which_times_out_naming_it(packed):
    syncs, _ = _syncs(3, polls=50, packed=packed)
    _begun(syncs[1], 0, FP, arrived=True)  # rank 2 never arrives
    syncs[0].begin(0, FP)
    assert not syncs[0].arrive_first(0, FP)  # polled 50 times, then gave up without a clock
    with pytest.raises(CommTimeoutError, match=r"rank\(s\) \[2\]"):
        syncs[0].settle_first(_ctx(0, FP, timeout=0.05))


@pytest.mark.parametrize("packed", [False, True])
def test_arrive_first_does_not_accept_a_rank_that_began_another_op_and_settle_first_names_it(packed):
    syncs, _ = _syncs(3, polls=50, packed=packed)
    _begun(syncs[1], 0, FP, arrived=True)
    _begun(syncs[2], 0, OTHER_FP, arrived=True)  # same sync, another call
    syncs[0].begin(0, FP)
    assert not syncs[0].arrive_first(0, FP)
    with pytest.raises(CollectiveMismatchError, match="rank 2 called all_reduce"):
        syncs[0].settle_first(_ctx(0, FP, timeout=1.0))
    assert syncs[0].transport.mismatches == [(2, 0, OTHER_FP)]


@pytest.mark.parametrize("packed", [False, True])
def test_the_op_words_of_the_other_parity_are_not_mistaken_for_this_op(packed):
    syncs, control = _syncs(2, polls=5, packed=packed)
    _begun(syncs[1], 0, FP, arrived=True)
    syncs[0].begin(0, FP)
    assert syncs[0].arrive_first(0, FP)
    # Op 1 uses parity 1: rank 1's parity-0 words still say op 0, which must not count.
    _begun(syncs[1], 1, OTHER_FP, arrived=True)
    syncs[0].begin(1, FP)
    assert control[syncs[1].mine + OP + 2] == 2  # rank 1's op 1, in the parity-1 words
    assert not syncs[0].arrive_first(1, FP)
    with pytest.raises(CollectiveMismatchError):
        syncs[0].settle_first(_ctx(1, FP, timeout=1.0))


@pytest.mark.parametrize("packed", [False, True])
def test_a_rank_already_in_the_next_op_still_counts_as_arrived_at_this_one(packed):
    syncs, _ = _syncs(3, polls=5, packed=packed)
    _begun(syncs[0], 0, FP, arrived=True)
    _begun(syncs[1], 0, FP, arrived=True)
    _begun(syncs[0], 1, OTHER_FP, arrived=True)  # rank 0 saw the sync end and ran on (parity 1)
    syncs[2].begin(0, FP)  # rank 2, late to op 0, must still find everyone arrived at it
    assert syncs[2].arrive_first(0, FP)
    if packed:
        assert syncs[2]._blocks[0].tobytes() == (1).to_bytes(8, sys.byteorder) * 3 + token(0, FP).to_bytes(8, sys.byteorder) * 3


@pytest.mark.parametrize("packed", [False, True])
def test_two_calls_whose_fingerprints_differ_in_a_low_bit_are_told_apart_one_seq_apart(packed):
    """gather and scatter of the same arguments differ in bit 0 of their fingerprints, as
    seq + 1 = 2 and 3 do: a rank one seq ahead (a monitored_barrier that timed out on it
    alone took one) in gather must not take its peer's scatter for the same op."""
    gather, scatter = fingerprint("gather", "float32", 1024, 0), fingerprint("scatter", "float32", 1024, 0)
    assert (2 + 1) ^ gather == (1 + 1) ^ scatter  # the plain XOR the token was: equal
    syncs, _ = _syncs(2, polls=5, packed=packed)
    _begun(syncs[1], 1, scatter, arrived=True)
    syncs[0].begin(2, gather)
    assert not syncs[0].arrive_first(2, gather)
    with pytest.raises(CollectiveMismatchError, match="rank 1 called scatter"):
        syncs[0].settle_first(_ctx(2, gather, timeout=1.0))


def test_tokens_differ_for_another_seq_or_another_fingerprint():
    fps = [fingerprint(op, dt, n, root) for op in ("gather", "scatter", "broadcast", "all_reduce")
           for dt in ("float32", "int64") for n in (1, 2, 1024) for root in (0, 1)]
    tokens = {token(seq, fp) for seq in range(64) for fp in fps}
    assert len(tokens) == 64 * len(set(fps))


@pytest.mark.parametrize("world, blocks", [(2, False), (6, True), (8, True), (9, False)])
def test_a_group_s_syncs_use_the_arrival_blocks_from_6_to_8_ranks(job, world, blocks):
    import chorus as dist
    from chorus.testing import run_threads

    def body(rank, w):
        data = np.full(3, rank + 1.0)
        dist.all_reduce(data)
        return dist.group.WORLD.shm.sync._blocks is not None, data.tolist()

    for used, data in run_threads(body, world):
        assert used is blocks and data == [world * (world + 1) / 2] * 3


def test_groups_of_6_to_8_ranks_have_arrival_blocks_and_others_do_not():
    from chorus.shm.window import Layout

    assert [Layout(w, 1 << 16).counts - Layout(w, 1 << 16).arrivals for w in (1, 2, 5, 6, 8, 9, 64)] == \
        [0, 0, 0, 256, 256, 0, 0]


def test_a_later_sync_polls_before_it_waits_and_waits_with_the_deadline_when_polls_run_out(monkeypatch):
    syncs, _ = _syncs(2, polls=30)
    waits = []
    monkeypatch.setattr(Sync, "_wait", lambda self, target, ctx: waits.append(target))
    _begun(syncs[1], 0, FP, arrived=True)
    syncs[0].begin(0, FP)
    assert syncs[0].arrive_first(0, FP)
    syncs[1].count += 1
    syncs[1].control[syncs[1].mine + ARRIVED] = syncs[1].count  # rank 1 is at sync 2 already
    syncs[0].sync(_ctx(0, FP, 1.0))
    assert waits == []  # found at the first read
    syncs[0].sync(_ctx(0, FP, 1.0))  # sync 3: rank 1 is not there
    assert waits == [3]


def _woken_syncs(world: int, packed: bool = False):
    """Syncs over a control area and a header page of their own (an anonymous shared
    mapping, as the window's), each with a Waker, and with arrival blocks if ``packed``;
    the test is skipped where futexes are unavailable."""
    import mmap

    header = mmap.mmap(-1, shm_sync.HEADER_PAGE)
    wakers = [shm_sync.Waker.make(header, world, r) for r in range(world)]
    if wakers[0] is None:
        pytest.skip("no futex system call here")
    control = memoryview(np.zeros(world * WORDS, np.uint64)).cast("B").cast("Q")
    transport = _Transport()
    arrivals = memoryview(np.zeros(32, np.uint64)).cast("B") if packed else None
    syncs = [Sync(control, r, tuple(range(world)), transport, 0, Backoff(yield_s=0.0), wakers[r], arrivals)
             for r in range(world)]
    return syncs, wakers


def _wait_until_in_futex(task_dir: str) -> None:
    """Wait until the thread whose /proc ``task_dir`` is given sits in the futex system
    call (so that a wake-up, not a changed word, is what ends its sleep); where /proc
    does not say, wait a moment."""
    number = shm_sync._futex_call()[1]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"{task_dir}/syscall") as f:
                if f.read().split()[0] == str(number):
                    return
        except (OSError, IndexError):
            time.sleep(0.2)
            return
        time.sleep(0.001)
    raise AssertionError("the waiter never went to sleep")


@pytest.mark.parametrize("world, sleeper, how, packed", [
    (2, 1, "sync", False), (3, 0, "first", False), (3, 0, "first", True), (8, 5, "first", True),
    (10, 9, "sync", False), (10, 2, "first", False)])
def test_a_napping_waiter_is_woken_by_the_last_arrival_not_by_its_nap(monkeypatch, world, sleeper, how, packed):
    """Rank ``sleeper`` waits long enough to nap (naps of 3 s); every other rank has
    arrived but the last, which completes the sync through ``how`` (a later sync, or an
    op's first sync).  Only the wake-up (chorus.shm.sync.Waker) lets the sleeper leave within
    a fraction of its nap; with 10 ranks the sleep marks span two words."""
    import threading

    monkeypatch.setattr(shm_sync, "NAP_MIN", 3.0)
    monkeypatch.setattr(shm_sync, "NAP_MAX", 3.0)
    syncs, wakers = _woken_syncs(world, packed)
    last = world - 1 if sleeper != world - 1 else 0
    left, first = [], how == "first"
    for s in syncs:
        s.begin(0, FP)

    def waiter():
        syncs[sleeper].sync(_ctx(0, FP, 30.0), first=first)
        left.append(time.monotonic())

    for r in range(world):
        if r not in (sleeper, last):
            if first:
                _begun(syncs[r], 0, FP, arrived=True)  # (its arrival block word too)
            else:
                syncs[r]._arrive()
    thread = threading.Thread(target=waiter)
    thread.start()
    _wait_until_in_futex(f"/proc/self/task/{thread.native_id}")
    arrived = time.monotonic()
    syncs[last].sync(_ctx(0, FP, 30.0), first=first)  # completes the sync: wakes the sleeper
    thread.join(5)
    assert left and left[0] - arrived < 1.0, left[0] - arrived if left else "never left"
    assert wakers[last].wakes == 1 and wakers[sleeper].marks[sleeper] == 0


def test_a_sleeping_process_is_woken_by_another_process():
    """The futex is shared between processes (not FUTEX_PRIVATE_FLAG): a forked child
    sleeping on the word is woken by the parent's wake-up."""
    import mmap
    import os

    header = mmap.mmap(-1, shm_sync.HEADER_PAGE)  # shared with the child across fork
    if shm_sync.Waker.make(header, 2, 0) is None:
        pytest.skip("no futex system call here")
    pid = os.fork()
    if pid == 0:  # the child: sleep 3 s unless woken; exit 0 if woken within 1 s
        code = 1
        try:
            start = time.monotonic()
            shm_sync.Waker.make(header, 2, 1).sleep(3.0, lambda: False)
            code = 0 if time.monotonic() - start < 1.0 else 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + 5
    parent = shm_sync.Waker.make(header, 2, 0)
    while not parent.marks[1] and time.monotonic() < deadline:
        time.sleep(0.001)
    _wait_until_in_futex(f"/proc/{pid}/task/{pid}")
    parent.wake()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert parent.wakes == 1


def test_nobody_asleep_no_wake_call_and_a_sleep_ends_at_its_timeout():
    _, wakers = _woken_syncs(3)
    for w in wakers:  # nobody is marked asleep: no system call
        w.wake()
    assert [w.wakes for w in wakers] == [0, 0, 0]
    start = time.monotonic()
    wakers[2].sleep(0.05, lambda: False)  # nobody wakes it: its timeout ends the sleep
    assert 0.04 <= time.monotonic() - start < 1.0 and wakers[2].marks[2] == 0
    start = time.monotonic()
    wakers[2].sleep(5.0, lambda: True)  # the condition holds once marked asleep: no sleep at all
    assert time.monotonic() - start < 0.5


def test_backoff_settings(monkeypatch):
    """Ranks with a core each poll, then yield 5 ms; oversubscribed hosts and thread ranks
    yield 1 ms and never poll; CHORUS_SHM_SPIN_US spins; CHORUS_SHM_YIELD_US sets the
    yield phase of any of them."""
    monkeypatch.setattr(placement, "usable", lambda: 8)
    with config.override(CHORUS_SHM_SPIN_US=None, CHORUS_SHM_YIELD_US=None, CHORUS_SHM_POLLS=7):
        assert placement.backoff_for(8, False) == Backoff(polls=7)
        assert placement.backoff_for(9, False) == placement.backoff_for(2, True) == Backoff(spin_s=0.0, yield_s=1e-3)
        with config.override(CHORUS_SHM_YIELD_US=20000):
            assert placement.backoff_for(8, False) == Backoff(yield_s=0.02, polls=7)
            assert placement.backoff_for(2, True).yield_s == 0.02
            with config.override(CHORUS_SHM_SPIN_US=50):
                spinning = placement.backoff_for(8, False)
    assert spinning.spin_s == pytest.approx(50e-6) and (spinning.yield_s, spinning.polls) == (0.02, 7)
