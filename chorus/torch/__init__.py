"""chorus as a ``torch.distributed`` backend.

    import chorus.torch                     # registers backend "chorus" (CPU and CUDA tensors)
    import torch.distributed as dist

    dist.init_process_group("chorus")       # torchrun, chorusrun, env://, tcp://, file://, store=
    model = torch.nn.parallel.DistributedDataParallel(model)

DDP, FSDP2 (``fully_shard``), ``init_device_mesh``, DTensor, ``torch.distributed.checkpoint``
and ``new_group(backend="chorus")`` then run on chorus's transports, with chorus's
diagnostics: a dead rank or mismatched collective fails every rank within seconds with
``PeerLostError`` / ``CollectiveMismatchError`` instead of hanging.

Pieces (one concept per module):

* ``backend``   — ``ChorusProcessGroup``, the torch process group whose methods run chorus
  collectives;
* ``work``      — ``TorchWork``, the torch ``Work`` / ``Future`` over chorus ops;
* ``fabric``    — chorus transports and groups made from what torch passes the backend;
* ``stores``    — store adapters in both directions;
* ``rendezvous``— ``init_method="chorus://"``, and ``env://`` through chorusrun's store;
* ``errors``    — chorus's errors as torch's ``DistBackendError`` / ``DistNetworkError`` /
  ``DistStoreError``;
* ``profiling`` — each op as an event of torch's profiler;
* ``sparse``    — all_reduce of sparse COO tensors.

Registration: torch 2.13 loads out-of-tree *device* extensions through the
``torch.backends`` entry-point group, but has no entry point for *process-group*
backends; chorus does not hook the device group for this (it would import chorus and
register the backend in every torch process, even those that never use it).  So
``import chorus.torch`` is the one line to add.  It is the only chorus module that
imports torch.distributed; ``import chorus`` never imports torch.

CUDA tensors run on chorus's CUDA component (chorus.cuda: CUDA IPC inside a host), with
ProcessGroupNCCL's stream semantics; ``"cpu:chorus,cuda:nccl"`` keeps NCCL for them.
"""

from __future__ import annotations

import torch.distributed as dist

from chorus.torch import rendezvous
from chorus.torch.backend import BACKEND_NAME, ChorusProcessGroup, chorus_op
from chorus.torch.stores import ChorusView, TorchView
from chorus.torch.work import TorchWork

__all__ = ["BACKEND_NAME", "ChorusProcessGroup", "ChorusView", "TorchView", "TorchWork", "chorus_op",
           "create_process_group", "register"]


def create_process_group(opts, backend_options=None) -> ChorusProcessGroup:
    """The backend creator torch calls (extended API) for every group of backend "chorus"."""
    from chorus.torch.errors import as_torch_error
    from chorus.torch.fabric import join

    try:
        membership = join(opts.store, opts.group_rank, opts.group_size, opts.timeout.total_seconds(),
                          str(opts.group_id), list(opts.global_ranks_in_group))
    except BaseException as exc:
        as_torch_error(exc)  # RendezvousError: a DistNetworkError, StoreTimeoutError: a DistStoreError
        raise
    return ChorusProcessGroup(membership, opts.group_rank, opts.group_size, str(opts.group_id))


def register() -> None:
    """Register backend "chorus" with torch.distributed (idempotent; done on import)."""
    if BACKEND_NAME.upper() not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu", "cuda"])
    rendezvous.install()


register()
