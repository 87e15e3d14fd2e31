"""The cases of the differential test (chorus vs torch gloo), shared by the process
workers and the thread runs.  ``run_case(api, case, rank, world, group)`` returns the
case's outputs as numpy arrays (None for a non-member), with ``api`` either chorus or
torch.distributed; inputs are torch tensors for both."""

from __future__ import annotations

import zlib

import numpy as np
import torch

DTYPES = {"int": torch.int64, "float": torch.float32, "bf16": torch.bfloat16, "complex": torch.complex64,
          "bool": torch.bool}
REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
OPS = {"int": ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"], "float": ["SUM", "PRODUCT", "MIN", "MAX"],
       "bf16": ["SUM", "MAX"], "complex": ["SUM"], "bool": ["SUM", "MIN"]}
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "gather", "scatter",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single")


def cases():
    for coll in COLLECTIVES:
        for family in DTYPES:
            for op in (OPS[family] if coll in REDUCING else [None]):
                for sub in (False, True):
                    yield (coll, family, op, sub)


def _tensor(case, rank, n, salt=0):
    coll, family, op, sub = case
    seed = zlib.crc32(repr((coll, family, op, sub, rank, n, salt)).encode())  # same in every process
    g = torch.Generator().manual_seed(seed)
    if family == "bool":
        return torch.randint(0, 2, (n,), generator=g).bool()
    if family == "complex":
        return torch.complex(torch.randint(-3, 4, (n,), generator=g).float(),
                             torch.randint(-3, 4, (n,), generator=g).float())
    low, high = (1, 4) if op == "PRODUCT" else (-9, 10)
    return torch.randint(low, high, (n,), generator=g).to(DTYPES[family])


def members(world, sub):
    """The world, or a sub-group of all ranks but the middle one (0, 1, 3 of 4: on two
    simulated hosts a, a, b, b it spans both, two ranks on a)."""
    return [r for r in range(world) if not sub or r != world // 2]


def run_case(api, case, rank, world, group):
    coll, family, op, sub = case
    ranks = members(world, sub)
    if rank not in ranks:
        return None
    w, me = len(ranks), ranks.index(rank)
    root = ranks[-1]
    n = 5
    kw = {"group": group}
    if op is not None:
        kw["op"] = getattr(api.ReduceOp, op)
    x = _tensor(case, rank, n)
    if coll == "all_reduce":
        api.all_reduce(x, **kw)
        return [x]
    if coll == "reduce":
        api.reduce(x, dst=root, **kw)
        return [x] if rank == root else None
    if coll == "broadcast":
        api.broadcast(x, src=root, **kw)
        return [x]
    if coll == "all_gather":
        out = [torch.zeros_like(x) for _ in range(w)]
        api.all_gather(out, x, **kw)
        return out
    if coll == "all_gather_into_tensor":
        out = torch.zeros(w * n, dtype=x.dtype)
        api.all_gather_into_tensor(out, x, **kw)
        return [out]
    if coll == "gather":
        out = [torch.zeros_like(x) for _ in range(w)] if rank == root else None
        api.gather(x, out, dst=root, **kw)
        return out
    if coll == "scatter":
        y = torch.zeros_like(x)
        api.scatter(y, [_tensor(case, r, n, salt=1) for r in range(w)] if rank == root else None, src=root, **kw)
        return [y]
    if coll == "reduce_scatter":
        y = torch.zeros(n, dtype=x.dtype)
        api.reduce_scatter(y, [_tensor(case, rank, n, salt=i) for i in range(w)], **kw)
        return [y]
    if coll == "reduce_scatter_tensor":
        y = torch.zeros(n, dtype=x.dtype)
        api.reduce_scatter_tensor(y, _tensor(case, rank, n * w, salt=2), **kw)
        return [y]
    if coll == "all_to_all":
        outs = [torch.zeros(n, dtype=x.dtype) for _ in range(w)]
        api.all_to_all(outs, [_tensor(case, rank, n, salt=10 + i) for i in range(w)], **kw)
        return outs
    if coll == "all_to_all_single":
        splits_in = [(me + j) % 3 for j in range(w)]  # uneven: rank me sends (me + j) % 3 rows to j
        splits_out = [(j + me) % 3 for j in range(w)]
        y = torch.zeros(sum(splits_out), dtype=x.dtype)
        api.all_to_all_single(y, _tensor(case, rank, sum(splits_in), salt=3), splits_out, splits_in, **kw)
        return [y]
    raise AssertionError(coll)


def as_numpy(outputs):
    if outputs is None:
        return None
    return [t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy().copy() for t in outputs]


def same(a, b, family):
    if a is None or b is None:
        return a is None and b is None
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if family in ("int", "bool"):
            if not np.array_equal(x, y):
                return False
        elif not np.allclose(x, y, rtol=1e-2 if family == "bf16" else 1e-5, atol=1e-6):
            return False
    return True
