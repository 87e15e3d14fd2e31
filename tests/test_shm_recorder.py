"""What the shared-memory collectives tell a recorder (chorus.recorder): one ``sync`` event
per window sync, one ``copy`` per copy into or out of the window (or per single-copy read
of a peer, naming it), one ``reduce`` per local reduction, each naming its op, with byte
counts that add up to what the op moves.  Ranks are threads: one listener sees every
rank's events, so the checks are on sums over the group.

The ops run with ``async_op=True``: synchronous numpy calls take the latency paths
(ShmGroup.all_reduce_planned, all_to_all_fast), which report nothing; the component
that calls them steps aside to the general path while a listener is attached."""

from collections import defaultdict

import numpy as np
import pytest

import chorus as dist
from chorus import config, recorder
from chorus.shm import phases
from chorus.testing import run_threads

SLOT = 64 << 10  # 16384 float32 per slot
SMALL, BIG, GATHERED, EXCHANGED = 100, 40_000, 1000, 500  # float32 elements (BIG: 3 chunks)


def _ops(rank, world):
    """Small all_reduce, multi-chunk all_reduce, all_gather, all_to_all, in that order."""
    dist.all_reduce(np.full(SMALL, rank, np.float32), async_op=True).wait()
    big = np.full(BIG, rank, np.float32)
    dist.all_reduce(big, async_op=True).wait()
    out = np.zeros(world * GATHERED, np.float32)
    dist.all_gather_into_tensor(out, np.full(GATHERED, rank, np.float32), async_op=True).wait()
    exchanged = np.zeros(world * EXCHANGED, np.float32)
    dist.all_to_all_single(exchanged, np.full(world * EXCHANGED, rank, np.float32), async_op=True).wait()
    return bool((big == sum(range(world))).all() and (out.reshape(world, -1)[:, 0] == np.arange(world)).all())


def _recorded(body, world, **settings):
    """Run ``body`` on ``world`` thread ranks with ``settings`` (config.override) and a
    listener attached: (results, the transfer events; each op's begin and end, which the
    component reports around them, are left out)."""
    events = []
    recorder.attach(events.append)
    try:
        with config.override(**settings):
            results = run_threads(body, world)
    finally:
        recorder.detach()
    return results, [e for e in events if e.what not in ("begin", "end")]


def _totals(events):
    """{(op, seq): {what: [count, bytes]}} over every rank's events."""
    found = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for e in events:
        found[(e.op, e.seq)][e.what][0] += 1
        found[(e.op, e.seq)][e.what][1] += e.nbytes
    return {key: {what: tuple(v) for what, v in by.items()} for key, by in found.items()}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("world", [2, 3])
def test_every_sync_copy_and_reduction_is_reported_with_its_op_and_bytes(world, threads, monkeypatch):
    monkeypatch.setattr(phases, "PART_ROW_BYTES", 256)
    results, events = _recorded(_ops, world, CHORUS_SHM_SLOT_BYTES=SLOT, CHORUS_SHM_THREADS=threads,
                                CHORUS_SHM_PART_BYTES=1024, CHORUS_SHM_COPY_CREW_BYTES=0)  # threads 2: in parts
    assert all(results)
    assert events and all(e.component == "shm" and e.group == 0 and e.start <= e.end for e in events)
    assert {e.what for e in events} == {"sync", "copy", "reduce"}
    small, big, gather, exchange = sorted(_totals(events).items(), key=lambda kv: kv[0][1])
    w, f = world, 4  # bytes per float32

    assert small[0][0] == big[0][0] == "all_reduce"
    # one-shot: every rank copies its data in, syncs once, reduces the W slots
    assert small[1] == {"copy": (w, w * SMALL * f), "sync": (w, 0), "reduce": (w, w * w * SMALL * f)}
    # three chunks: groups of 2 reduce every chunk whole; larger ones reduce-scatter + all-gather
    chunks = 3
    copies, syncs = big[1]["copy"], big[1]["sync"]
    if w == 2:
        assert copies[1] == w * BIG * f and syncs == (w * chunks, 0)
        assert big[1]["reduce"][1] == w * w * BIG * f
    else:
        assert copies[1] == 2 * w * BIG * f and syncs == (w * (chunks + 1), 0)  # copied in, and out
        assert big[1]["reduce"][1] == w * BIG * f  # each rank its slice of every chunk
    copy_stages = 1 if w == 2 else 2
    assert copies[0] >= copy_stages * w * chunks and big[1]["reduce"][0] >= w * chunks  # (more with parts)

    assert gather[0][0] == "all_gather"
    assert gather[1] == {"copy": (gather[1]["copy"][0], w * (1 + w) * GATHERED * f), "sync": (w, 0)}
    assert exchange[0][0] == "all_to_all"
    assert exchange[1] == {"copy": (exchange[1]["copy"][0], 2 * w * w * EXCHANGED * f), "sync": (w, 0)}
    if threads == 1:
        assert gather[1]["copy"][0] == exchange[1]["copy"][0] == 2 * w  # one copy in, one out, per rank


def test_single_copy_reads_name_the_peer_they_read():
    """all_gather with single copy: every rank reads every other rank's block (a ``copy``
    naming that rank), between the op's two syncs."""
    def body(rank, world):
        if dist.group.WORLD.shm.window.cma is None:
            return None
        out = np.zeros(world * GATHERED, np.float32)
        dist.all_gather_into_tensor(out, np.full(GATHERED, rank, np.float32), async_op=True).wait()
        return bool((out.reshape(world, -1)[:, -1] == np.arange(world)).all())

    results, events = _recorded(body, 3, CHORUS_SHM_CMA_BYTES=1024)
    if results[0] is None:
        pytest.skip("process_vm_readv is not usable here")
    assert all(results)
    copies = [e for e in events if e.what == "copy"]
    assert sorted(e.peer for e in copies) == [0, 0, 1, 1, 2, 2]  # each rank read by the two others
    assert all(e.op == "all_gather" and e.nbytes == GATHERED * 4 and e.detail == {"direction": "read"}
               for e in copies)
    assert sum(e.what == "sync" for e in events) == 3 * 2


def test_nothing_is_reported_once_the_listener_is_detached():
    events = []
    recorder.attach(events.append)
    recorder.detach()
    run_threads(_ops, 2)
    assert events == []
