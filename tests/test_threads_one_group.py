"""Several threads of one rank on one group (ProcessGroup.enter): a collective called while
another thread of the rank is inside one of the group's collectives raises
ConcurrentCallError at once, before anything is sent; it never runs beside it and mixes
the two ops' data."""

from __future__ import annotations

import contextvars
import os
import threading

import numpy as np
import pytest

import chorus as dist
from chorus.testing import run_threads


def _thread(target, *args, name=None) -> threading.Thread:
    """A thread of this rank: run_threads' ranks are threads, each with its chorus state
    in a context variable, which a new thread gets from a copy of the caller's context."""
    return threading.Thread(target=contextvars.copy_context().run, args=(target, *args), name=name)


@pytest.mark.parametrize("kind", ["lane", "general"])
def test_a_second_thread_is_refused_while_the_first_is_inside(kind):
    """Rank 0's thread A waits inside an all_reduce for rank 1, which holds back until
    rank 0's main thread was refused; then A's all_reduce completes with the right sum."""
    refused = threading.Event()

    def body(rank, world):
        pg = dist.group.WORLD
        x = np.full(1000, float(rank + 1), np.float32)
        op = dist.ReduceOp.SUM if kind == "lane" else dist.ReduceOp.MAX

        def call(arr):
            if kind == "lane":
                dist.all_reduce(arr, op=op)
            else:  # a named algorithm: the general path, run inline (synchronous) while it waits
                dist.all_reduce(arr, op=op, algorithm="ring")

        if rank == 1:
            assert refused.wait(30)
            call(x)
            return x[0], None
        got = {}
        a = _thread(lambda: got.setdefault("a", call(x)), name="thread-A")
        a.start()
        while pg.entry:  # until A holds the group's entry (no sleep: the token is taken in microseconds)
            pass
        try:
            dist.all_reduce(np.ones(4, np.float32))
        except dist.ConcurrentCallError as exc:
            error = str(exc)
        else:
            error = "not refused"
        refused.set()
        a.join(30)
        return x[0], error

    results = run_threads(body, 2)
    want = 3.0 if kind == "lane" else 2.0
    assert [r[0] for r in results] == [want, want]
    error = results[0][1]
    assert "all_reduce on group WORLD from thread 'rank0' while " in error and "new_group" in error, error
    if kind == "general":
        assert "thread 'thread-A' is inside all_reduce" in error, error


def test_two_threads_hammering_one_group_never_get_mixed_data():
    """Two threads a rank, 60 all_reduces each on WORLD, retrying when refused.  Which
    thread's op meets which on the other rank is up to the threads (ranks must order a
    group's ops alike; these do not), but every result is a whole sum of one op per rank:
    never a mixture, a stale buffer or a hang."""
    n = 1000
    values = {(r, t): float(10 * r + t + 1) for r in range(2) for t in range(2)}
    sums = {values[(0, a)] + values[(1, b)] for a in range(2) for b in range(2)}

    def body(rank, world):
        out = {"bad": [], "refused": 0, "done": 0}
        lock = threading.Lock()

        def worker(t):
            for _ in range(60):
                while True:
                    x = np.full(n, values[(rank, t)], np.float32)
                    try:
                        dist.all_reduce(x)
                    except dist.ConcurrentCallError:
                        with lock:
                            out["refused"] += 1
                        os.sched_yield()  # (the other thread holds the group: let it run)
                        continue
                    break
                if not (x == x[0]).all() or float(x[0]) not in sums:
                    out["bad"].append(sorted(set(x.tolist()))[:4])
                with lock:
                    out["done"] += 1

        threads = [_thread(worker, t) for t in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        return out

    for out in run_threads(body, 2, timeout=90):
        assert out["done"] == 120 and out["bad"] == [], out
