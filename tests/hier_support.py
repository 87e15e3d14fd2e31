"""What the hierarchical tests share: the simulated host layouts (``CHORUS_HOST_ID``),
inputs whose every reduction order is exact, and raw bytes to compare results bit for bit."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

LAYOUTS = {"2+2": "a,a,b,b", "3+2": "a,a,a,b,b", "1+3": "a,b,b,b", "interleaved": "a,b,a,b,b"}


def values(rank, n, dtype, salt=0):
    """Small integers in -2..2: sums and products over 5 ranks are exact in every dtype."""
    v = (rank * 7 + np.arange(n) * 3 + salt) % 5 - 2
    return torch.tensor(v, dtype=torch.bfloat16) if dtype == "bfloat16" else v.astype(dtype)


def bits(t):
    """The raw bytes of a tensor, to compare bit for bit."""
    return t.view(torch.int16).numpy().copy() if isinstance(t, torch.Tensor) else t.view(np.uint8).copy()
