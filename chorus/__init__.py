"""chorus: collective communication for Python with the torch.distributed API.

``import chorus as dist`` and use it as you would ``torch.distributed``::

    dist.init_process_group("gloo")          # or "chorus"; env:// by default
    dist.send(t, dst=1); dist.recv(t, src=0)
    dist.barrier()
    dist.destroy_process_group()

Run scripts with ``chorusrun --nproc-per-node 4 script.py`` (torchrun's flags), or call
``chorus.spawn(fn, args, nprocs)`` as you would ``torch.multiprocessing.spawn``.
"""

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# name -> module that defines it.  Loaded on first use (PEP 562), so `import chorus` and
# `chorusrun --help` do not pay for numpy, sockets and threads they may never need.
_EXPORTS = {
    "chorus.api.collectives": ["all_reduce", "barrier", "broadcast", "monitored_barrier", "reduce"],
    "chorus.api.exchange": ["all_to_all", "all_to_all_single", "reduce_scatter", "reduce_scatter_single",
                            "reduce_scatter_tensor"],
    "chorus.api.gathering": ["all_gather", "all_gather_into_tensor", "all_gather_single", "gather",
                             "scatter"],
    "chorus.reductions": ["ReduceOp", "_make_nccl_premul_sum"],
    "chorus.api.groups": ["GroupMember", "get_global_rank", "get_group_rank", "get_process_group_ranks",
                          "group", "new_group", "new_subgroups", "new_subgroups_by_enumeration",
                          "split_group"],
    "chorus.api.init": ["Backend", "destroy_process_group", "get_backend", "get_rank", "get_world_size",
                        "init_process_group", "is_available", "is_gloo_available", "is_initialized",
                        "is_mpi_available", "is_nccl_available", "is_torchelastic_launched"],
    "chorus.api.p2p": ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"],
    "chorus.api.objects": ["all_gather_object", "broadcast_object_list", "gather_object", "recv_object_list",
                           "scatter_object_list", "send_object_list"],
    "chorus.errors": ["AbortedError", "AuthenticationError", "BufferMismatchError", "ChorusError",
                      "CollectiveMismatchError", "CommTimeoutError", "ConcurrentCallError", "DeadlockError",
                      "InvalidArgumentError",
                      "InvalidTensorError", "NotInitializedError", "PeerLostError", "ProtocolError",
                      "RendezvousError", "StoreTimeoutError", "UnsafeObjectError"],
    "chorus.process_group": ["ProcessGroup"],
    "chorus.launch": ["get_start_method", "set_start_method", "spawn"],
    "chorus.mesh": ["DeviceMesh", "init_device_mesh"],
    "chorus.store": ["FileStore", "HashStore", "PrefixStore", "Store", "TCPStore"],
    "chorus.work": ["Future", "Work"],
    "chorus.shm.registered": ["empty_shared"],
    "chorus.api.safe_pickle": ["add_safe_globals", "clear_safe_globals", "get_safe_globals"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
# torch.distributed's submodules that scripts reach as attributes: dist.device_mesh.init_device_mesh
_SUBMODULES = {"device_mesh": "chorus.mesh"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _SUBMODULES:
        value = globals()[name] = importlib.import_module(_SUBMODULES[name])
        return value
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'chorus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static analysers see the eager imports
    from chorus.api.collectives import barrier  # noqa: F401
    from chorus.api.init import init_process_group  # noqa: F401
