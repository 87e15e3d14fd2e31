"""Turning the process groups torch creates into chorus process groups.

torch calls the backend's creator once per process group, on its members only, with the
group's own store (a PrefixStore of the job's store), the group rank and size, the
timeout and the group's global ranks.  chorus answers with a *fabric* — one chorus
transport plus the chorus ``World`` that owns it — and a chorus ``ProcessGroup`` on it:

* torch's default group makes the **world fabric**: a TCP transport over every rank,
  rendezvoused through the default group's store (chorus's full-mesh set-up: each rank
  publishes its listening address, lower ranks are dialled), plus the shared-memory
  window when all ranks share a host.  Its ``World`` is private to ``chorus.torch``, so
  ``chorus.init_process_group`` and torch's ``init_process_group("chorus")`` never
  step on each other.
* every later chorus group (``new_group(backend="chorus")``, DeviceMesh dimensions, ...)
  is a chorus ``ProcessGroup`` on the world fabric: no new sockets, only a group id,
  which group rank 0 draws from a counter in the world's store and publishes in the
  group's store.
* a chorus group in a job whose default group is *not* chorus (e.g. gloo) gets a fabric
  of its own over its members, rendezvoused through its own store.

Its connections prove the job token: ``CHORUS_TOKEN``; else the one chorus's own
rendezvous used (``init_method="chorus://"``); else, for torch's default group of a job
whose ranks all share this host (single-node torchrun, ``mp.spawn`` with a loopback
MASTER_ADDR), a secret rank 0 derives and hands the others through a file only this user
can read (``chorus.host.secret``) — torch's own store stays unauthenticated, chorus's
transport does not.  A sub-group's own fabric proves ``CHORUS_TOKEN`` or nothing.

Fabrics say goodbye to their peers at ``destroy_process_group`` (torch calls the
group's ``shutdown``) and at a normal interpreter exit; after an uncaught exception they
do not, so the peers see this rank as crashed (``PeerLostError``), as chorus does.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading

from chorus import config, net
from chorus.api import crash
from chorus.api.init import attach_components, destroy_process_group, install
from chorus.api.state import World, current, use_world
from chorus.host.secret import LocalSecret, job_secret
from chorus.process_group import ProcessGroup
from chorus.rendezvous import detect_environment
from chorus.store import PrefixStore, Store
from chorus.torch import rendezvous
from chorus.torch.stores import tcp_address
from chorus.transport.tcp import TcpTransport, local_address_towards

log = logging.getLogger("chorus")


class entered:  # noqa: N801 - used like a function: ``with entered(world): ...``
    """Make ``world`` chorus's current World in this thread for the duration of a call
    (the thread may be torch's autograd thread or the user's)."""

    __slots__ = ("world", "saved")

    def __init__(self, world: World):
        self.world = world

    def __enter__(self) -> None:
        self.saved = current()
        use_world(self.world)

    def __exit__(self, *exc) -> None:
        use_world(self.saved)


class Fabric:
    """A chorus transport over ``size`` ranks and the World that owns it."""

    def __init__(self, store: Store, rank: int, size: int, timeout: float, token: bytes | None = None,
                 secret: LocalSecret | None = None):
        try:
            generation = store.add(f"chorus/generation/{rank}", 1)  # equal on every rank of one set-up
            self.store = PrefixStore(f"chorus/{generation}", store)
            transport = TcpTransport(rank, size, self.store, token=token, timeout=timeout,
                                     host=local_address_towards(os.environ.get("MASTER_ADDR")))
        finally:
            if secret is not None:
                secret.release()  # rank 0: every rank has connected (each read it), or set-up failed
        self.world = World()
        self.closed = False
        with entered(self.world):
            # the store: for what components agree on at a group's first use (chorus.cuda's
            # workspace handles); a prefix view, which destroying the world leaves open
            install(self.world, transport, "chorus", timeout, store=self.store)
        _live.add(self)

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.world_size

    def add_group(self, group_store: Store, group_rank: int, members: tuple[int, ...], timeout: float,
                  name: str) -> ProcessGroup:
        """A chorus group of global ranks ``members`` on this fabric (every member calls it)."""
        key = f"{self.store.prefix}/group_id"  # one per world set-up, in the group's own store
        if group_rank == 0:
            gid = self.store.add("next_group_id", 1)
            group_store.set(key, str(gid))
        else:
            gid = int(group_store.get(key))
        pg = ProcessGroup(gid, members, self.rank, self.world.transport, timeout, name=name, backend="chorus")
        pg.channels = self.world.channels
        self.world.groups[gid] = pg
        with entered(self.world):
            attach_components(pg)
        return pg

    def drop_group(self, pg: ProcessGroup) -> None:
        if not self.closed:
            with entered(self.world):
                destroy_process_group(pg)

    def close(self) -> None:
        """Say BYE to every peer and close the transport (idempotent)."""
        if self.closed:
            return
        self.closed = True
        _live.discard(self)
        with entered(self.world):
            if self.world.default_group is not None:
                destroy_process_group()


class _Live:
    """The fabrics of this process that are still open, closed at a normal exit."""

    def __init__(self):
        self._fabrics: set[Fabric] = set()
        self._lock = threading.Lock()
        self._hooked = False
        self.crashed = False
        self.world: Fabric | None = None  # the fabric of torch's default group, if chorus

    def add(self, fabric: Fabric) -> None:
        with self._lock:
            self._fabrics.add(fabric)
            if not self._hooked:
                self._hooked = True
                self._hook_exit()

    def discard(self, fabric: Fabric) -> None:
        with self._lock:
            self._fabrics.discard(fabric)
            if self.world is fabric:
                self.world = None

    def _hook_exit(self) -> None:
        previous = sys.excepthook

        def note_crash(*exc_info):
            self.crashed = True
            previous(*exc_info)

        sys.excepthook = note_crash
        atexit.register(self._close_all)

    def _close_all(self) -> None:
        if self.crashed or crash.has_failed():  # has_failed: also a spawned function's raise
            return  # the peers must see a crash, not a clean goodbye
        for fabric in list(self._fabrics):
            try:
                fabric.close()
            except Exception as exc:  # noqa: BLE001 - nothing to do at exit but log
                log.debug("chorus.torch: clean-up at exit failed: %s", exc)


_live = _Live()


class Membership:
    """What one torch process group holds: its chorus group and how to let go of it."""

    def __init__(self, fabric: Fabric, pg: ProcessGroup, owns_fabric: bool):
        self.fabric = fabric
        self.world = fabric.world
        self.pg = pg
        self._owns_fabric = owns_fabric

    def close(self) -> None:
        if self._owns_fabric:
            self.fabric.close()
        else:
            self.fabric.drop_group(self.pg)


def join(torch_store, group_rank: int, group_size: int, timeout: float, name: str,
         global_ranks: list[int]) -> Membership:
    """The chorus group for one torch process group (called on every member)."""
    from chorus.torch.stores import ChorusView

    store = ChorusView(torch_store)
    world = _live.world
    if global_ranks and world is not None and not world.closed and max(global_ranks) < world.size \
            and global_ranks[group_rank] == world.rank:
        return Membership(world, world.add_group(store, group_rank, tuple(global_ranks), timeout, name), False)
    if global_ranks:  # a sub-group of a job whose default group is not chorus
        fabric = Fabric(store, group_rank, group_size, timeout, net.get_token())
    else:  # torch's default group: later chorus groups share this transport
        token, secret = world_token(torch_store, group_rank, group_size, timeout)
        fabric = Fabric(store, group_rank, group_size, timeout, token, secret)
        _live.world = fabric
    return Membership(fabric, fabric.world.default_group, True)


def world_token(torch_store, rank: int, size: int, timeout: float) -> tuple[bytes | None, LocalSecret | None]:
    """The token the world fabric's connections prove, and the derived secret (if any) whose
    file rank 0 removes once its transport is connected (see the module's docstring)."""
    explicit = net.get_token()
    handed = rendezvous.take_token()  # chorus://: what chorus's rendezvous proved
    if explicit is not None or handed is not None:
        return explicit or handed[0], None if handed is None else handed[1]
    if config.get("CHORUS_STORE_HOSTED"):
        return None, None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not port.strip().isdigit():
        addr, port = tcp_address(torch_store) or (None, None)
    env = detect_environment()
    secret = job_secret(rank, size, addr, None if port is None else int(port), timeout,
                        local_world_size=env["local_world_size"], launcher_world_size=env["world_size"],
                        what=f"rank 0 of this job (MASTER_ADDR {addr}, MASTER_PORT {port})")
    return (None, None) if secret is None else (secret.token, secret)
