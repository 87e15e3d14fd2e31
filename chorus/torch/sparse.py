"""all_reduce of a sparse COO tensor, as gloo does it: the sum, on every rank, in place.

chorus's collectives move dense memory; a sparse tensor is two dense ones (its indices and
its values) whose length (``nnz``) differs by rank.  So each rank contributes its coalesced
indices and values, every rank gathers all of them, and every rank adds them up the same
way (in rank order, ``coalesce()``), which gives the same tensor everywhere::

    rank 0: indices [[0, 2]]  values [1., 2.]          size (4,)
    rank 1: indices [[2, 3]]  values [10., 20.]        size (4,)
    after:  indices [[0, 2, 3]]  values [1., 12., 20.] on both ranks

Three all_gathers: each rank's (nnz, sparse dims, dense dims, size...), then the indices
and the values padded to the largest nnz.  Only ``ReduceOp.SUM`` (gloo's only one); other
ops, and ranks whose tensors differ in size, fail with a message saying so.
"""

from __future__ import annotations

import torch

from chorus.api import gathering
from chorus.errors import InvalidArgumentError
from chorus.reductions import ReduceOp


def all_reduce_sparse(t: torch.Tensor, op, pg) -> None:
    """Replace sparse COO tensor ``t`` with the sum of every rank's ``t`` (group ``pg``)."""
    if op is not ReduceOp.SUM:
        raise InvalidArgumentError(
            f"chorus.torch all_reduce: sparse tensors are reduced with ReduceOp.SUM only (as gloo), "
            f"got {op}; reduce t.to_dense() for other ops")
    local = t.detach().coalesce()
    nnz = local.indices().shape[1]
    meta = torch.tensor([nnz, local.sparse_dim(), local.dense_dim(), *local.shape], dtype=torch.int64)
    metas = [torch.empty_like(meta) for _ in range(pg.size())]
    gathering.all_gather(metas, meta, group=pg)
    for rank, other in enumerate(metas):
        if not torch.equal(other[1:], meta[1:]):
            raise InvalidArgumentError(
                f"chorus.torch all_reduce: rank {pg.members[rank]}'s sparse tensor has size "
                f"{tuple(other[3:].tolist())} with {int(other[1])} sparse dims, this rank's "
                f"{tuple(local.shape)} with {local.sparse_dim()}; every rank must pass the same size")
    counts = [int(m[0]) for m in metas]
    widest = max(counts)
    if widest == 0:
        return
    indices = _padded(local.indices(), widest, dim=1)
    values = _padded(local.values(), widest, dim=0)
    all_indices = [torch.empty_like(indices) for _ in counts]
    all_values = [torch.empty_like(values) for _ in counts]
    gathering.all_gather(all_indices, indices, group=pg)
    gathering.all_gather(all_values, values, group=pg)
    total = torch.sparse_coo_tensor(
        torch.cat([i[:, :n] for i, n in zip(all_indices, counts, strict=True)], dim=1),
        torch.cat([v[:n] for v, n in zip(all_values, counts, strict=True)], dim=0),
        local.shape).coalesce()
    with torch.no_grad():
        t.copy_(total)


def _padded(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``x`` contiguous, grown with zeros to ``length`` along ``dim``."""
    missing = length - x.shape[dim]
    if missing == 0:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim).contiguous()
