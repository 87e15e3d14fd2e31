"""How chorus.cuda's component turns the control page and the transport's state into
errors (no GPU needed: the page is plain host memory here, read through
chorus.cuda.runtime.host_words as the pinned page is)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

from chorus.cuda import layout as L
from chorus.cuda import runtime
from chorus.cuda.component import CudaComponent
from chorus.errors import (
    AbortedError,
    BufferMismatchError,
    CollectiveMismatchError,
    CommTimeoutError,
    InvalidArgumentError,
    PeerLostError,
)


class FakeTransport:
    def __init__(self):
        self.dead, self.error, self.listeners, self.mismatches = {}, None, [], []
        self.mismatched, self.closed_reason = {}, None

    def failure(self, group, peer, expect=None):
        return self.error

    def group_mismatch(self, group, culprit, seq, fingerprint, detector):
        self.mismatches.append((group, culprit, seq, fingerprint, detector))

    def add_failure_listener(self, fn):
        self.listeners.append(fn)


def component():
    pg = SimpleNamespace(id=3, name="g3", members=(4, 5, 6), timeout=2.0, transport=FakeTransport(),
                         rank=lambda: 0)
    comp = CudaComponent(pg, None)
    page = (ctypes.c_int64 * L.CONTROL_WORDS)()
    comp.ws = SimpleNamespace(words=runtime.host_words(ctypes.addressof(page), L.CONTROL_WORDS), page=page)
    return comp


def test_timeout_names_op_and_ranks_and_sticks():
    comp = component()
    op = comp.names.add("all_reduce (op #7 of group g3)")
    w = comp.ws.words
    w[L.FAIL_OP], w[L.FAIL_WHAT], w[L.FAIL_PEERS], w[L.STATUS] = op, L.WAIT_BARRIER, 0b110, L.TIMEOUT
    with pytest.raises(CommTimeoutError, match=r"all_reduce \(op #7 of group g3\): Timed out after 2 s .*\[5, 6\]"):
        comp.check("broadcast")
    assert w[L.ABORT] == 1
    with pytest.raises(CommTimeoutError):  # broken from now on
        comp.check("all_gather")


def test_transport_failure_wins_and_listener_aborts():
    comp = component()
    comp.pg.transport.error = PeerLostError("rank 5 died", lost_rank=5)
    comp.pg.transport.dead[5] = "died"
    with pytest.raises(PeerLostError, match="all_reduce on group g3") as err:
        comp.check("all_reduce")
    assert err.value.lost_rank == 5

    comp = component()
    comp._on_failure(-1, "rank 9 died")  # not a member: nothing
    assert comp.ws.words[L.ABORT] == 0
    comp.pg.transport.dead[5] = "died"
    comp._on_failure(-1, "rank 5 died")
    assert comp.ws.words[L.ABORT] == 1
    comp.ws.words[L.STATUS] = L.ABORTED
    with pytest.raises(AbortedError):
        comp.check("send")


def test_size_mismatch_is_fatal_tag_mismatch_is_not():
    comp = component()
    op = comp.names.add("recv from rank 5 (tag 3)")
    w = comp.ws.words
    w[L.TAG_PEER], w[L.TAG_EXPECT], w[L.TAG_GOT], w[L.TAG_OP] = 1, 3, 4, op + 1
    with pytest.raises(InvalidArgumentError, match="expected tag 3 but rank 5's matching send has tag 4"):
        comp.check("recv")
    comp.check("recv")  # reported once; the channel is still in step
    w[L.FAIL_OP], w[L.FAIL_PEERS], w[L.FAIL_EXPECT], w[L.FAIL_GOT], w[L.STATUS] = op, 0b10, 80, 40, L.SIZE_MISMATCH
    with pytest.raises(BufferMismatchError, match="sent 40 bytes but this rank receives 80"):
        comp.check("recv")


def test_mismatch_names_both_calls_and_tells_the_transport():
    from chorus.wire.fingerprint import fingerprint

    comp = component()
    mine = fingerprint("all_reduce", "float32", 1 << 32, -1, "SUM")  # above 2**63: a negative word
    theirs = fingerprint("all_gather", "float32", 1 << 30)
    op = comp.names.add("all_reduce (op #9 of group g3)", 9, mine)
    w = comp.ws.words
    w[L.FAIL_OP], w[L.FAIL_PEERS], w[L.FAIL_FP], w[L.STATUS] = op, 0b100, theirs - (1 << 64) * (theirs >> 63), L.MISMATCH
    with pytest.raises(CollectiveMismatchError) as err:
        comp.check("all_reduce")
    text = str(err.value)
    assert "rank 6 called all_gather(float32, count=1073741824) as op #9" in text, text
    assert "this rank (rank 4) called all_reduce(float32, count=4294967296, op=SUM)" in text, text
    assert comp.pg.transport.mismatches == [(3, 6, 9, theirs, 4)]
    assert w[L.ABORT] == 1
    with pytest.raises(CollectiveMismatchError):  # broken from now on, told once
        comp.check("broadcast")
    assert len(comp.pg.transport.mismatches) == 1


def test_a_failed_barrier_aborts_the_groups_nccl_communicator():
    """A barrier in front of a handed-off op found another op: the check that raises also
    has the NCCL communicator aborted (its kernel, queued behind the barrier, would wait
    for peers that called something else)."""
    comp = component()
    aborts = []
    comp._nccl = SimpleNamespace(broken=None, abort_soon=lambda: aborts.append(1))
    op = comp.names.add("all_gather (op #4 of group g3)", 4, 12)
    w = comp.ws.words
    w[L.FAIL_OP], w[L.FAIL_PEERS], w[L.FAIL_FP], w[L.STATUS] = op, 0b10, 13, L.MISMATCH
    with pytest.raises(CollectiveMismatchError):
        comp.check("all_gather")
    assert aborts == [1]


def test_op_names_keep_the_last_ops_and_forget_older_ones():
    """OpNames: an id names its op while it is among the last KEPT; an older id, an id
    never given and 0 (no op) name nothing."""
    from chorus.cuda.failures import KEPT, OpNames

    names = OpNames("g3")
    first = names.add(None, seq=7, fprint=5, name="all_reduce")
    assert names.entry(first) == ("all_reduce (op #7 of group g3)", 7, 5)
    ids = [names.add(f"send {i}", seq=i) for i in range(KEPT - 1)]
    assert names.entry(first) is not None and names.entry(ids[-1]) == (f"send {KEPT - 2}", KEPT - 2, 0)
    names.add("one more")
    assert names.entry(first) is None and names.entry(ids[0]) == ("send 0", 0, 0)
    assert names.entry(0) is None and names.entry(names.last + 1) is None
    assert names.entry(-1) is None and names.entry(-KEPT) is None and names.entry(2**64 + names.last) is None
    assert names.described(first, "an op") == "an op"
