"""One benchmark case per collective, written once against the torch.distributed API —
the same code times chorus (``api`` = chorus) and torch gloo (``api`` =
torch.distributed).

Every rank's input is ``pattern(rank, n)[i] = rank + 1 + i % 7``, so a misplaced block
or a missing contribution shows.  ``size`` is nccl-tests' size: the bytes of the larger
of the two buffers (the full output of all_gather, the full input of reduce_scatter).
A case is ``(reset, step, check)``: ``reset`` restores the inputs (untimed), ``step`` runs
one collective (timed), ``check`` counts wrong elements (untimed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
               "sendrecv", "barrier")


def pattern(rank: int, n: int, dtype: str) -> np.ndarray:
    return (rank + 1 + np.arange(n) % 7).astype(dtype)


def counts(collective: str, size_elems: int, world: int) -> tuple[int, int]:
    """(input elements, output elements) per rank; 0 output = in place."""
    block = size_elems // world
    return {
        "all_reduce": (size_elems, 0), "broadcast": (size_elems, 0), "reduce": (size_elems, 0),
        "all_gather": (block, block * world), "reduce_scatter": (block * world, block),
        "all_to_all": (block * world, block * world), "sendrecv": (size_elems, size_elems),
        "barrier": (0, 0),
    }[collective]


def expected(collective: str, rank: int, world: int, n_in: int, n_out: int, dtype: str) -> np.ndarray | None:
    """What the checked buffer must hold after one step (None: nothing to check)."""
    total = sum(pattern(r, max(n_in, n_out), dtype).astype(np.float64) for r in range(world))
    if collective == "all_reduce" or (collective == "reduce" and rank == 0):
        return total[:n_in]
    if collective in ("broadcast", "reduce"):
        return pattern(0 if collective == "broadcast" else rank, n_in, dtype)
    block = n_out // world if collective != "reduce_scatter" else n_out
    if collective == "all_gather":
        return np.concatenate([pattern(r, block, dtype) for r in range(world)])
    if collective == "reduce_scatter":
        return total[rank * block: (rank + 1) * block]
    if collective == "all_to_all":
        return np.concatenate([pattern(r, n_in, dtype)[rank * block: (rank + 1) * block] for r in range(world)])
    if collective == "sendrecv":
        return pattern((rank - 1) % world, n_in, dtype)
    return None


def make_case(api: Any, lib: str, collective: str, size_elems: int, dtype: str, rank: int,
              world: int) -> tuple[Callable[[], None], Callable[[], None], Callable[[], int]]:
    n_in, n_out = counts(collective, size_elems, world)
    template = pattern(rank, n_in, dtype)
    inp, out = _tensor(lib, template.copy()), _tensor(lib, np.zeros(n_out, dtype))
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    steps: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: api.all_reduce(inp),
        "broadcast": lambda: api.broadcast(inp, src=0),
        "reduce": lambda: api.reduce(inp, dst=0),
        "all_gather": lambda: api.all_gather_into_tensor(out, inp),
        "reduce_scatter": lambda: api.reduce_scatter_tensor(out, inp),
        "all_to_all": lambda: api.all_to_all_single(out, inp),
        "barrier": lambda: api.barrier(),
        "sendrecv": lambda: [w.wait() for w in (api.irecv(out, src=prv), api.isend(inp, dst=nxt))],
    }
    expect = expected(collective, rank, world, n_in, n_out, dtype)
    checked = inp if n_out == 0 else out

    def reset() -> None:
        _numpy(inp)[...] = template

    def check() -> int:
        if expect is None:
            return 0
        return int(np.count_nonzero(_numpy(checked) != expect.astype(dtype)))

    return reset, steps[collective], check


def _tensor(lib: str, arr: np.ndarray) -> Any:
    if lib == "chorus":
        return arr
    import torch

    return torch.from_numpy(arr)


def _numpy(t: Any) -> np.ndarray:
    return t if isinstance(t, np.ndarray) else t.numpy()
