"""The recorder sees every component: op begin/end with the call's identity, and the
transfers or phases inside (TCP schedules: send/recv; shared memory: sync/copy/reduce;
hierarchical: one phase per sub-group op), for all_reduce, all_gather and all_to_all."""

import collections

import numpy as np
import pytest

import chorus as dist
from chorus import recorder
from chorus.testing import run_threads

pytestmark = pytest.mark.usefixtures("job")


@pytest.fixture
def events():
    seen = []
    lock_free_append = seen.append  # list.append is atomic under the GIL: ranks are threads
    recorder.attach(lock_free_append)
    yield seen
    recorder.detach()


def program(rank, w):
    """all_reduce (small and large), all_gather and all_to_all_single on every rank."""
    small = np.full(4, rank + 1, np.float32)
    large = np.full(300_000, rank + 1, np.float32)  # 1.2 MB: several chunks or segments
    dist.all_reduce(small)
    dist.all_reduce(large)
    outs = [np.zeros(8, np.int32) for _ in range(w)]
    dist.all_gather(outs, np.full(8, rank, np.int32))
    a2a_out = np.zeros(4 * w, np.int64)
    dist.all_to_all_single(a2a_out, np.arange(4 * w, dtype=np.int64) + 100 * rank)
    expect = w * (w + 1) / 2
    assert small[0] == expect and large[-1] == expect
    assert [int(o[0]) for o in outs] == list(range(w))
    assert a2a_out.reshape(w, 4)[:, 0].tolist() == [100 * q + 4 * rank for q in range(w)]


def summary(seen, group=0):
    """{(op, component): Counter(what)} for the events of ``group``."""
    out = collections.defaultdict(collections.Counter)
    for e in seen:
        if e.group == group:
            out[(e.op, e.component)][e.what] += 1
    return out


def check_ops(seen, component, ops, world, transfer_kinds):
    s = summary(seen)
    for op in ops:
        counts = s[(op, component)]
        calls = 2 if op == "all_reduce" else 1
        assert counts["begin"] == counts["end"] == calls * world, (op, component, dict(counts))
        assert any(counts[k] for k in transfer_kinds), (op, component, dict(counts))
    for e in seen:
        assert e.end >= e.start
        if e.what in ("send", "recv"):
            assert e.peer >= 0 and e.nbytes > 0


def test_tcp_schedules_report_ops_and_every_send_and_receive(monkeypatch, events):
    monkeypatch.setenv("CHORUS_TRANSPORT", "tcp")
    run_threads(program, 3)
    check_ops(events, "tcp", ["all_reduce", "all_gather", "all_to_all"], 3, ["send", "recv"])
    sends = [e for e in events if e.what == "send" and e.op == "all_gather"]
    assert sum(e.nbytes for e in sends) >= 3 * 2 * 8 * 4  # every block leaves every rank at least once
    begins = [e for e in events if e.what == "begin"]
    assert all(e.algorithm for e in begins) and {e.seq for e in begins} == {0, 1, 2, 3}


def test_shared_memory_reports_ops_and_every_sync_copy_and_reduction(events):
    run_threads(program, 3)
    check_ops(events, "shm", ["all_reduce", "all_gather", "all_to_all"], 3, ["sync"])
    s = summary(events)
    assert s[("all_reduce", "shm")]["reduce"] and s[("all_reduce", "shm")]["copy"]
    assert s[("all_gather", "shm")]["copy"] and s[("all_to_all", "shm")]["copy"]
    moved = sum(e.nbytes for e in events if e.what == "copy" and e.op == "all_gather")
    assert moved >= 3 * 3 * 8 * 4  # every rank copies every block (in, then out) at least once


def test_hierarchical_ops_report_their_phases_and_the_sub_groups_ops(monkeypatch, events):
    monkeypatch.setenv("CHORUS_HOST_ID", "a,a,b,b")
    monkeypatch.setenv("CHORUS_HIER_RING_BYTES", "0")  # the large all_reduce in phases too
    run_threads(program, 4)
    check_ops(events, "hierarchical", ["all_reduce", "all_gather"], 4, ["phase"])
    check_ops(events, "tcp", ["all_to_all"], 4, ["send", "recv"])  # all_to_all stays flat
    phases = [e for e in events if e.what == "phase" and e.group == 0]
    # the large all_reduce: reduce_scatter in the host, all_reduce in the column, all_gather;
    # all_gather: gather in the host, all_gather among the leaders, broadcast
    assert {e.detail["collective"] for e in phases} >= {"reduce_scatter", "all_reduce", "broadcast", "gather",
                                                        "all_gather"}
    sub_groups = {e.group for e in events if e.what == "begin" and e.group != 0}
    assert len(sub_groups) == 4  # two hosts' groups, the leaders' (the first column) and the second column


def test_a_large_all_reduce_across_hosts_reports_the_ring_and_its_transfers(monkeypatch, events):
    monkeypatch.setenv("CHORUS_HOST_ID", "a,a,b,b")
    run_threads(program, 4)
    ways = [(e.component, e.algorithm) for e in events if e.what == "begin" and e.group == 0 and e.op == "all_reduce"]
    assert ways.count(("hierarchical", "ring")) == 4, ways  # the large one; the small one runs two phases
    moved = [e for e in events if e.what in ("send", "recv") and e.group == 0 and e.op == "all_reduce"]
    assert {e.what for e in moved} == {"send", "recv"} and all(e.peer >= 0 for e in moved)


def test_nothing_is_reported_once_detached(events):
    recorder.detach()
    run_threads(program, 2)
    assert events == []
