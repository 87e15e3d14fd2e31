"""chorus: collective communication for Python with the torch.distributed API.

``import chorus as dist`` and use it as you would ``torch.distributed``::

    dist.init_process_group("gloo")          # or "chorus"; env:// by default
    dist.send(t, dst=1); dist.recv(t, src=0)
    dist.barrier()
    dist.destroy_process_group()

Run scripts with ``chorusrun --nproc-per-node 4 script.py`` (torchrun's flags), or call
``chorus.spawn(fn, args, nprocs)`` as you would ``torch.multiprocessing.spawn``.
"""

from chorus.api.collectives import barrier
from chorus.api.groups import (
    GroupMember,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    group,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
)
from chorus.api.init import (
    Backend,
    destroy_process_group,
    get_backend,
    get_rank,
    get_world_size,
    init_process_group,
    is_available,
    is_gloo_available,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
)
from chorus.api.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from chorus.errors import (
    AbortedError,
    AuthenticationError,
    BufferMismatchError,
    ChorusError,
    CollectiveMismatchError,
    CommTimeoutError,
    InvalidArgumentError,
    InvalidTensorError,
    NotInitializedError,
    PeerLostError,
    ProtocolError,
    RendezvousError,
    StoreTimeoutError,
)
from chorus.group import ProcessGroup
from chorus.launch import spawn
from chorus.store import FileStore, HashStore, PrefixStore, Store, TCPStore
from chorus.work import Future, Work

__version__ = "0.1.0"

__all__ = [
    "AbortedError", "AuthenticationError", "Backend", "BufferMismatchError", "ChorusError",
    "CollectiveMismatchError", "CommTimeoutError", "FileStore", "Future", "GroupMember",
    "HashStore", "InvalidArgumentError", "InvalidTensorError", "NotInitializedError", "P2POp",
    "PeerLostError", "PrefixStore", "ProcessGroup", "ProtocolError", "RendezvousError", "Store",
    "StoreTimeoutError", "TCPStore", "Work", "barrier", "batch_isend_irecv",
    "destroy_process_group", "get_backend", "get_global_rank", "get_group_rank",
    "get_process_group_ranks", "get_rank", "get_world_size", "group", "init_process_group",
    "irecv", "is_available", "is_gloo_available", "is_initialized", "is_mpi_available",
    "is_nccl_available", "is_torchelastic_launched", "isend", "new_group", "new_subgroups",
    "new_subgroups_by_enumeration", "recv", "send", "spawn",
]
