"""Starting and stopping a job: ``init_process_group`` and friends."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

from chorus import trace
from chorus.api import crash
from chorus.api.state import World, current, initialized_world
from chorus.debug import flight
from chorus.errors import InvalidArgumentError
from chorus.process_group import ProcessGroup
from chorus.work import seconds

DEFAULT_TIMEOUT_S = 600.0
#: Backend names accepted by init_process_group.  chorus serves all of them itself, on CPU
#: tensors, so scripts written for torch.distributed run unchanged; get_backend() returns
#: the name that was asked for.
BACKENDS = ("chorus", "gloo", "nccl", "mpi")


class Backend(str):
    """torch's ``Backend`` names (``Backend.GLOO == "gloo"``)."""

    CHORUS = "chorus"
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"
    UNDEFINED = "undefined"

    def __new__(cls, name: str):
        return str.__new__(cls, _check_backend(name))


def _check_backend(backend: str | None) -> str:
    if backend is None:
        return "chorus"
    if not isinstance(backend, str):
        raise InvalidArgumentError(f"init_process_group: backend must be a string, got {type(backend).__name__}")
    # torch also accepts "cpu:gloo,cuda:nccl": take the CPU entry or the first one.
    entries = [e.split(":")[-1].strip().lower() for e in backend.split(",") if e.strip()]
    cpu = [e.split(":")[-1].strip().lower() for e in backend.split(",") if e.strip().lower().startswith("cpu:")]
    name = (cpu or entries or [""])[0]
    if name not in BACKENDS:
        raise InvalidArgumentError(
            f"init_process_group: unknown backend {backend!r}; chorus accepts {', '.join(BACKENDS)} "
            "(all run on chorus's own transports)"
        )
    return name


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: timedelta | float | None = None, world_size: int = -1, rank: int = -1,
                       store=None, group_name: str = "", pg_options=None, device_id=None) -> None:
    """Join the job: find the other ranks (rendezvous), connect to them, create the world group.

    ``init_method``: ``"env://"`` (default; MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, also
    set by chorusrun/torchrun, or SLURM / Open MPI / PMI variables), ``"tcp://host:port"``,
    ``"file:///path"``; or pass a ``store`` with ``rank`` and ``world_size``.
    ``timeout`` (default 10 min) bounds set-up and every later op of the default group.

    Every rank calls it once, before any other op.  Under chorusrun or torchrun the
    environment says who is who; by hand, each rank names itself::

        rank 0: init_process_group("gloo", init_method="tcp://10.0.0.1:29500", rank=0, world_size=2)
        rank 1: init_process_group("gloo", init_method="tcp://10.0.0.1:29500", rank=1, world_size=2)
          -> rank 0: get_rank() == 0   rank 1: get_rank() == 1   both: get_world_size() == 2
    """
    world = current()
    if world.default_group is not None:
        raise InvalidArgumentError(
            "init_process_group: the default process group is already initialized in this process; "
            "call destroy_process_group() before initializing again"
        )
    name = _check_backend(backend)
    if store is not None and init_method is not None:
        raise InvalidArgumentError("init_process_group: pass either init_method or store, not both")
    t = seconds(timeout)
    t = DEFAULT_TIMEOUT_S if t is None else t
    if t <= 0:
        raise InvalidArgumentError(f"init_process_group: timeout must be positive, got {t} s")
    from chorus.rendezvous import rendezvous  # imported here so that `import chorus` stays fast
    from chorus.store import PrefixStore
    from chorus.transport.tcp import TcpTransport, local_address_towards

    info = rendezvous(init_method, rank, world_size, timedelta(seconds=t), store)
    try:
        generation = info.store.add(f"chorus/inits/{info.rank}", 1)
        job_store = PrefixStore(f"chorus/{generation}", info.store)
        # info.token: CHORUS_TOKEN, or the secret derived for a job on one host (chorus.host.secret)
        transport = TcpTransport(info.rank, info.world_size, job_store, token=info.token, timeout=t,
                                 host=local_address_towards(info.master_addr))
    finally:
        if info.secret is not None:
            info.secret.release()  # rank 0: every rank has connected (each read it), or set-up failed
    # (the world's store a view of this init's keys: a group's CUDA set-up counts its attaches
    # there, and a store kept across inits must not carry one init's counts into the next)
    world.closes = info.store
    install(world, transport, name, t, job_store, info.local_rank, info.local_world_size)
    flight.install_signal_dumps(info.rank)  # with CHORUS_FLIGHT_RECORDER_DIR: dump on SIGTERM/SIGINT
    trace.start(info.rank, info.world_size, PrefixStore(f"chorus/{generation}/trace", info.store))  # CHORUS_TRACE


def install(world: World, transport, backend: str, timeout: float, store=None,
            local_rank: int = 0, local_world_size: int = 1) -> None:
    """Make ``transport`` this rank's world (used by init_process_group and chorus.testing)."""
    # imported here so that `import chorus` stays fast
    from chorus.components.channels import open_channels

    world.backend = backend
    world.store = store
    world.transport = transport
    world.rank = transport.rank
    world.world_size = transport.world_size
    world.local_rank = local_rank
    world.local_world_size = local_world_size
    world.group_count = 0
    flight.forget(transport.rank)  # a new world: the flight recorder starts afresh
    world.default_group = ProcessGroup(0, tuple(range(transport.world_size)), transport.rank, transport,
                                       timeout, name="WORLD", backend=backend)
    world.groups = {0: world.default_group}
    crash.install(destroy_process_group)  # BYE at a normal exit; the cause to the peers at a failure
    try:
        # every rank, now: the job's extra TCP transports for large all_reduces, if the
        # ranks agree on any (chorus.components.channels)
        world.channels = world.default_group.channels = open_channels(transport, store, timeout)
        attach_components(world.default_group)
    except BaseException:
        destroy_process_group()
        raise


def attach_components(pg: ProcessGroup) -> None:
    """Give ``pg`` its collective components: a shared-memory window when every member is
    on this host, a hierarchy when it spans hosts and some host has several members, TCP
    schedules always (chorus.components.select).  Every member calls this when the group
    is created; the shared-memory handshake inside is collective."""
    from chorus.components.select import attach  # imported here so that `import chorus` stays fast

    attach(pg)


def destroy_process_group(group=None) -> None:
    """Leave the job (``group=None``) or forget one sub-group.

    Leaving tells every peer this rank is going (so they do not mistake it for a crash),
    closes connections and threads, and allows ``init_process_group`` again.

    rank 0: destroy_process_group()   rank 1: destroy_process_group()
      -> both: is_initialized() == False; ops raise NotInitializedError until the next init
    """
    world = initialized_world("destroy_process_group")
    if group is not None and group is not world.default_group:
        _close_shm(world.groups.pop(getattr(group, "id", None), None))
        return
    trace.stop({pg.id: pg.name for pg in world.groups.values()})  # writes CHORUS_TRACE's file
    for pg in world.groups.values():
        _close_shm(pg)
    transport, store, channels = world.transport, world.closes, world.channels
    world.default_group = None
    world.channels = None
    world.groups = {}
    world.transport = None
    world.store = world.closes = None
    world.rank = world.world_size = -1
    if channels is not None:
        channels.close()
    transport.close()
    close = getattr(store, "close", None)
    if close is not None:
        close()


def _close_shm(pg: ProcessGroup | None) -> None:
    if pg is not None and pg.components:
        from chorus.components.select import detach

        detach(pg)  # a hierarchy's hidden sub-groups go with it


def is_initialized() -> bool:
    """True between ``init_process_group`` and ``destroy_process_group`` in this process."""
    return current().default_group is not None


def is_available() -> bool:
    """True: chorus always has its collectives (torch's says whether it was built with them)."""
    return True


def is_gloo_available() -> bool:
    """chorus accepts backend "gloo" (and runs it on its own transports)."""
    return True


def is_nccl_available() -> bool:
    """Whether backend "nccl" moves CUDA tensors here: chorus serves that name with its own
    CUDA component wherever torch sees a GPU (and, as everywhere, CPU tensors), so this
    answers what torch's does on a machine with GPUs, and False without them.  Decided
    without importing torch (torch not imported yet: False)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


def is_mpi_available() -> bool:
    """False, as torch built without MPI answers: chorus uses no MPI library.  Backend
    "mpi" is still accepted and runs on chorus's own transports."""
    return False


def is_torchelastic_launched() -> bool:
    """True when torchrun or chorusrun started this process (TORCHELASTIC_RUN_ID is set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (default: the world); -1 if not a member.

    world of 4, g = new_group([1, 3]):
    rank 3: get_rank() == 3, get_rank(g) == 1     rank 0: get_rank() == 0, get_rank(g) == -1
    """
    world = initialized_world("get_rank")
    pg = world.default_group if group is None else group
    return pg.rank() if isinstance(pg, ProcessGroup) else -1


def get_world_size(group=None) -> int:
    """Number of ranks in ``group`` (default: the world); -1 if this rank is not a member.

    world of 4, g = new_group([1, 3]):
    rank 3: get_world_size() == 4, get_world_size(g) == 2     rank 0: get_world_size(g) == -1
    """
    world = initialized_world("get_world_size")
    pg = world.default_group if group is None else group
    return pg.size() if isinstance(pg, ProcessGroup) and pg.is_member() else -1


def get_backend(group=None) -> str:
    """The backend name given to init_process_group (chorus runs every one of them).

    every rank: init_process_group("nccl") -> get_backend() == "nccl"
    """
    return initialized_world("get_backend").backend
