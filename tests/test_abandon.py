"""Transport.abandon: an op given up on one transport of a rank because another part of
it failed elsewhere (chorus.components.channels), over the loopback transport."""

import numpy as np
import pytest

from chorus.errors import AbortedError
from chorus.transport.loopback import LoopbackFabric, LoopbackTransport
from chorus.wire.frames import Kind


@pytest.fixture
def pair():
    fabric = LoopbackFabric(2)
    ranks = LoopbackTransport(0, 2, fabric), LoopbackTransport(1, 2, fabric)
    for t in ranks:
        t.register_group(0, [0, 1])
    return ranks


def _recv(t, seq, fingerprint=77, tag=0):
    buf = np.zeros(4, np.float32)
    return t.irecv(1, memoryview(buf.view(np.uint8)), kind=Kind.COLL, group=0, tag=tag, expect=(seq, fingerprint))


def _send(t, seq, fingerprint=77, tag=0):
    return t.isend(0, memoryview(np.ones(4, np.float32).view(np.uint8)), kind=Kind.COLL, group=0, tag=tag,
                   seq=seq, fingerprint=fingerprint)


def test_an_abandoned_op_fails_its_receives_pending_and_to_come_and_no_other_op(pair):
    t0, _ = pair
    pending, other = _recv(t0, 5), _recv(t0, 6, tag=1)
    t0.abandon(0, 5, "another part failed")
    assert isinstance(pending.error, AbortedError) and "another part failed" in str(pending.error)
    assert isinstance(_recv(t0, 5, tag=2).error, AbortedError)  # posted afterwards: at once
    assert other.error is None and not other.done()


def test_a_late_frame_of_an_abandoned_op_is_dropped_not_taken_for_a_mismatch(pair):
    t0, t1 = pair
    t0.abandon(0, 5, "another part failed")
    _send(t1, 5)  # the peer's frame of that op, after this rank gave up on it
    t0.finished(0, 6)
    _send(t1, 5, tag=3)
    nxt = _recv(t0, 7)
    assert 0 not in t0.mismatched
    assert nxt.error is None
    _send(t1, 7)
    nxt.wait(1.0)
    assert nxt.error is None
