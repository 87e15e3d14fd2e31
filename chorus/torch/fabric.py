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

from chorus import net
from chorus.api import crash
from chorus.api.init import attach_components, destroy_process_group, install
from chorus.api.state import World, current, use_world
from chorus.process_group import ProcessGroup
from chorus.store import PrefixStore, Store
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

    def __init__(self, store: Store, rank: int, size: int, timeout: float):
        generation = store.add(f"chorus/generation/{rank}", 1)  # equal on every rank of one set-up
        self.store = PrefixStore(f"chorus/{generation}", store)
        transport = TcpTransport(rank, size, self.store, token=net.get_token(), timeout=timeout,
                                 host=local_address_towards(os.environ.get("MASTER_ADDR")))
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
    fabric = Fabric(store, group_rank, group_size, timeout)
    if not global_ranks:  # torch's default group: later chorus groups share this transport
        _live.world = fabric
    return Membership(fabric, fabric.world.default_group, True)
