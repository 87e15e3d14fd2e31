"""Rounds that every rank of a job runs alike for a while: rank 0's clock decides."""

import time

import numpy as np


def rounds(dist, seconds: float):
    """Yield 0, 1, 2, ... until ``seconds`` have passed on rank 0's clock; every rank gets
    the same count (rank 0 broadcasts whether to go on before each round)."""
    end, go, n = time.monotonic() + seconds, np.ones(1, np.float32), 0
    while True:
        go[0] = time.monotonic() < end
        dist.broadcast(go, src=0)
        if not go[0]:
            return
        yield n
        n += 1
