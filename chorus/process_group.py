"""``ProcessGroup``: who is in a group, rank translation, sequence numbers, the op queue.

This is the only place that translates between group ranks and global ranks.

Ordering: collectives of one group run in the order they were issued.  A synchronous op
on an idle group runs in the calling thread (no hand-off); an ``async_op=True`` op, or a
synchronous one issued while async ops are still queued, goes through the group's
worker thread, which runs the queue in order.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from chorus import config
from chorus.debug import flight
from chorus.engine import Combine, OpContext, Workspace, run_schedule
from chorus.errors import ConcurrentCallError, InvalidArgumentError
from chorus.schedules.base import Schedule
from chorus.transport.base import Transport
from chorus.transport.handles import Handle
from chorus.transport.waiting import WaitReport
from chorus.wire.frames import Kind


class ProcessGroup:
    """A set of global ranks that communicate together.

    ``members[i]`` is the global rank of group rank ``i``.  ``rank()`` is this process's
    group rank (-1 for a non-member, which can hold the object but not use it).
    """

    def __init__(self, group_id: int, members: tuple[int, ...], global_rank: int,
                 transport: Transport, timeout: float, name: str = "", backend: str = "chorus"):
        self.id = group_id
        self.members = tuple(members)
        self._group_rank_of = {g: i for i, g in enumerate(self.members)}
        self._rank = self._group_rank_of.get(global_rank, -1)
        self.transport = transport
        self.timeout = timeout
        self.name = name or str(group_id)
        self.backend = backend
        # The group whose ops this hidden sub-group's ops are phases of (chorus.components.
        # hierarchy): its errors are raised as that group's, named and settled there.
        self.phase_of: ProcessGroup | None = None
        self._seq = 0
        # One entry token: the thread inside one of the group's collectives holds it (enter);
        # the latency lanes pop and push it themselves (a list's pop and append are atomic).
        self.entry: list[None] = [None]
        self.inside = 0  # the ident of the thread that took the token through enter()
        self.inside_op = ""
        self.queue: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._queue_cv = threading.Condition()
        self._worker: threading.Thread | None = None
        self.workspace = Workspace()  # ops of a group never run concurrently: one suffices
        self.shm = None  # a chorus.shm.group.ShmGroup when every member shares this host
        self.hierarchy = None  # a chorus.components.hierarchy.Hierarchy when members span hosts
        self.channels = None  # the job's extra TCP transports (chorus.components.channels), if any
        # The collective components, in the order selection asks them
        # (chorus.components.select; set when the group is created).
        self.components: tuple = ()
        self.device_components: dict = {}  # "cuda" -> its component, made at first use
        self.lane = None  # the shared-memory component or the TCP lane, whose latency lanes the API tries first
        # CHORUS_SEND_MODE=rendezvous: sends complete once the peer's receive took them
        self.rendezvous = config.get("CHORUS_SEND_MODE") == "rendezvous"
        transport.register_group(group_id, self.members,
                                 WaitReport(global_rank, self.name, config.get("CHORUS_WAIT_REPORT_S")))

    def __repr__(self) -> str:
        return f"ProcessGroup(id={self.id}, ranks={list(self.members)}, rank={self._rank})"

    # -- ranks -------------------------------------------------------------------------------
    def rank(self) -> int:
        """This process's rank in the group (-1 if not a member)."""
        return self._rank

    def size(self) -> int:
        """The number of ranks in the group."""
        return len(self.members)

    def is_member(self) -> bool:
        """Whether this process is one of the group's ranks."""
        return self._rank >= 0

    def global_rank(self, group_rank: int, *, op: str = "op", what: str = "rank") -> int:
        """Global rank of ``group_rank``; InvalidArgumentError if it is not in the group."""
        if not isinstance(group_rank, int) or not 0 <= group_rank < len(self.members):
            raise InvalidArgumentError(
                f"{op}: {what} {group_rank!r} is not a rank of group {self.name} "
                f"(valid: 0..{len(self.members) - 1})"
            )
        return self.members[group_rank]

    def group_rank(self, global_rank: int, *, op: str = "op", what: str = "rank") -> int:
        """Group rank of ``global_rank``; InvalidArgumentError if it is not a member."""
        try:
            return self._group_rank_of[global_rank]
        except (KeyError, TypeError):
            raise InvalidArgumentError(
                f"{op}: {what} {global_rank!r} is not a member of group {self.name} "
                f"(members: {list(self.members)})"
            ) from None

    def deadline(self, timeout: float | None = None) -> float:
        return time.monotonic() + (self.timeout if timeout is None else timeout)

    # -- point-to-point ------------------------------------------------------------------------
    def post_send(self, view: memoryview, dst: int, tag: int, dtype: int, sync: bool) -> Handle:
        """Post a send to group rank ``dst`` (already validated)."""
        return self.transport.isend(self.members[dst], view, kind=Kind.DATA, group=self.id,
                                    tag=tag, dtype=dtype, sync=sync, rendezvous=self.rendezvous)

    def post_recv(self, view: memoryview, src: int | None, tag: int, dtype: int, waited: bool = False) -> Handle:
        """Post a receive from group rank ``src`` (None = any member); ``waited``: the caller
        waits for it at once (Transport.irecv)."""
        peer = None if src is None else self.members[src]
        return self.transport.irecv(peer, view, kind=Kind.DATA, group=self.id, tag=tag, dtype=dtype,
                                    waited=waited)

    # -- collectives ---------------------------------------------------------------------------
    def next_context(self, name: str, fingerprint: int, timeout: float | None = None) -> OpContext:
        """Take the next sequence number for a collective issued now."""
        return self.context(name, self.take_seq(), fingerprint, timeout)

    def enter(self, op: str) -> bool:
        """The calling thread is about to issue collective ``op`` of this group: take the
        group's entry token (True), or, when this thread holds it already (an op made of
        several collectives), False.  While another thread holds it, raise
        ConcurrentCallError: two threads inside one group's collectives at once would take
        each other's sequence numbers and mix their data.  ``leave()`` when True."""
        try:
            self.entry.pop()
        except IndexError:
            if self.inside == threading.get_ident():
                return False
            raise self._concurrent(op) from None
        self.inside = threading.get_ident()
        self.inside_op = op
        return True

    def enter_lane(self) -> bool:
        """Take the entry token for a latency lane's whole op (True), or False while
        another thread holds it: the lane steps aside and the general path raises
        ConcurrentCallError.  ``leave()`` when True."""
        try:
            self.entry.pop()
        except IndexError:
            return False
        return True

    def lane_op(self, ring, log: list, run: Callable[..., None], *args) -> bool:
        """``run(seq, *args)`` as this group's next op through a latency lane: the entry
        token and sequence number taken as the general path takes them, the op noted in
        the lane's ``log`` of flight recorder ``ring`` (None: no recorder).  False, with
        nothing run, while another thread holds the token."""
        # enter_lane(), take_seq() and leave() written out: this is every lane op's cost
        try:
            self.entry.pop()
        except IndexError:
            return False
        try:
            seq = self._seq
            self._seq = seq + 1
            if ring is None:
                run(seq, *args)
            else:
                flight.run_lane(ring, log, seq, run, *args)
        finally:
            self.entry.append(None)  # (self.inside is 0 already: only enter() sets it, leave() clears it)
        return True

    def leave(self) -> None:
        """Give the entry token back (after enter() or enter_lane() returned True)."""
        self.inside = 0
        self.entry.append(None)

    def _concurrent(self, op: str) -> ConcurrentCallError:
        me = threading.current_thread().name
        holder = next((t.name for t in threading.enumerate() if self.inside and t.ident == self.inside), None)
        # (a latency lane takes the token without naming its thread: it is the cheapest path)
        who = (f"thread {holder!r} is inside {self.inside_op}" if holder else
               "another thread of this rank is inside one of its collectives")
        return ConcurrentCallError(
            f"{op} on group {self.name} from thread {me!r} while {who} on the same "
            f"group: one thread at a time may call a group's collectives, and every rank must call them "
            f"in the same order (as with torch.distributed).  Serialize the threads' calls (a lock, the "
            f"same order on every rank) or give each thread a group of its own (new_group).")

    def take_seq(self) -> int:
        """The next sequence number, taken (collectives call in issue order)."""
        seq = self._seq
        self._seq = seq + 1
        return seq

    def context(self, name: str, seq: int, fingerprint: int, timeout: float | None = None) -> OpContext:
        """The context of op ``seq`` (taken already), its deadline counted from now.  The
        shared-memory latency path takes a sequence number alone and builds this only
        when it must wait or raise."""
        return OpContext(name, self.id, seq, fingerprint, self.members,
                         time.monotonic() + (self.timeout if timeout is None else timeout))

    def run_schedule(self, schedule: Schedule, buffers: dict, ctx: OpContext, dtype: int = 0,
                     combine: Combine | None = None, algorithm: str = "", channel: int | None = None) -> None:
        run_schedule(schedule, buffers, self.transport, ctx, dtype, combine, self.workspace, algorithm, channel)

    def submit(self, fn: Callable[[], Any], async_op: bool) -> Any:
        """Run ``fn`` in issue order: inline when idle and synchronous, else on the worker.

        Returns ``fn()``'s result (synchronous) or a concurrent Future (async_op).
        """
        if not async_op:
            if not self.queue:  # a deque's emptiness reads atomically: no lock on the fast path
                return fn()
            return self._enqueue(fn).result()
        return self._enqueue(fn)

    def _enqueue(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._queue_cv:
            self.queue.append((fn, future))
            if self._worker is None:
                self._worker = threading.Thread(target=self._work_loop, daemon=True,
                                                name=f"chorus-group{self.id}-worker")
                self._worker.start()
            self._queue_cv.notify()
        return future

    def _work_loop(self) -> None:
        while True:
            with self._queue_cv:
                while not self.queue:
                    self._queue_cv.wait()
                fn, future = self.queue[0]
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                future.set_exception(exc)
            finally:
                with self._queue_cv:
                    self.queue.popleft()
