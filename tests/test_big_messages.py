"""Messages larger than 2 GiB (the wire's length field is 64-bit).  Needs ~8 GiB of RAM,
so it runs only when CHORUS_BIG_TESTS=1."""

import os

import numpy as np
import pytest

import chorus as dist
from chorus.testing import run_processes

pytestmark = pytest.mark.skipif(os.environ.get("CHORUS_BIG_TESTS") != "1",
                                reason="needs ~8 GiB of RAM; set CHORUS_BIG_TESTS=1 to run")

NBYTES = (5 << 30) // 2  # 2.5 GiB


def _body(rank, world):
    n = NBYTES // 8
    if rank == 0:
        data = np.arange(n, dtype=np.int64)
        dist.send(data, dst=1)
        return None
    buf = np.empty(n, np.int64)
    dist.recv(buf, src=0)
    idx = np.array([0, 1, n // 2, n - 2, n - 1])
    return bool((buf[idx] == idx).all() and int(buf.sum(dtype=np.int64)) == n * (n - 1) // 2)


def test_a_2_5_gib_message_arrives_intact():
    assert run_processes(_body, 2, op_timeout=300)[1] is True
