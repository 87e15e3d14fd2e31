"""Reducing and rooted collectives: ``broadcast``, ``all_reduce``, ``reduce``, ``barrier``,
``monitored_barrier``.  Signatures and semantics are torch.distributed's; every one also
takes chorus's ``algorithm=`` keyword (see chorus.selection)."""

from __future__ import annotations

import functools

import numpy as np

from chorus import engine
from chorus.api.groups import resolve
from chorus.api.launch import member_group, not_member, root_rank, run, writable
from chorus.api.state import current
from chorus.buffers import as_buffer
from chorus.errors import CommTimeoutError, InvalidArgumentError, InvalidTensorError
from chorus.process_group import ProcessGroup
from chorus.reductions import ReduceOp, check_op, combiner, divide, rows_into, scale
from chorus.wire.fingerprint import fingerprint
from chorus.wire.frames import Kind
from chorus.work import Work, seconds


def broadcast(tensor, src: int | None = None, group=None, async_op: bool = False,
              group_src: int | None = None, algorithm: str | None = None) -> Work | None:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank.

    rank 0: t = [1, 2]   rank 1: t = [0, 0]   --broadcast(t, src=0)-->   both: [1, 2]
    """
    pg = member_group(group, "broadcast")
    if pg is None:
        return not_member(async_op)
    root = root_rank(pg, src, group_src, "broadcast", "src")
    buf = writable(tensor, "broadcast")
    return run(pg, "broadcast", dtype=buf.dtype, count=buf.numel, buffers={"data": buf.array},
               async_op=async_op, algorithm=algorithm, nbytes=buf.nbytes, root=root, after=buf.finish,
               result=[tensor], args={"count": buf.numel})


def _reduction(buf, op, name: str, world: int):
    """(combine, before, after) for a reduction: PREMUL_SUM scales first, AVG divides last."""
    check_op(op, buf.dtype, name)
    before = (lambda: scale(buf.array, buf.dtype, op.factor)) if op.name == "PREMUL_SUM" else None

    def after() -> None:
        if op.name == "AVG":
            divide(buf.array, buf.dtype, world)
        buf.finish()

    return combiner(op, buf.dtype), before, after


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False,
               algorithm: str | None = None) -> Work | None:
    """Reduce ``tensor`` over all ranks; every rank gets the result, in place.

    rank 0: [1, 2]   rank 1: [3, 4]   --all_reduce(SUM)-->   both: [4, 6]
    Results are bit-identical on every rank.
    """
    if type(tensor) is np.ndarray and not async_op and algorithm is None and _all_reduce_one_shot(tensor, op, group):
        return None
    pg = member_group(group, "all_reduce")
    if pg is None:
        return not_member(async_op)
    buf = writable(tensor, "all_reduce")
    combine, before, after = _reduction(buf, op, "all_reduce", pg.size())
    return run(pg, "all_reduce", dtype=buf.dtype, count=buf.numel, buffers={"data": buf.array},
               async_op=async_op, algorithm=algorithm, nbytes=buf.nbytes, reduce_op=op.name,
               combine=combine, before=before, after=after, result=[tensor], args={"count": buf.numel})


def _all_reduce_one_shot(arr: np.ndarray, op, group) -> bool:
    """The latency path: a small synchronous all_reduce of a numpy array on a group with a
    shared-memory window runs here, from a plan cached per (dtype, shape, op), and returns
    True; anything else (large, queued behind async ops, recorded, non-contiguous,
    misaligned, read-only, PREMUL_SUM, not a member, not initialized, bad arguments)
    returns False and takes the general path, which gives the same result or the same
    error.

    Every check here is one a repeated call needs: the group's last plan is kept with the
    dtype, shape and op it was made for (under the key None of the group's plans, so that
    whatever clears the plans clears it), compared by identity where that is exact (a
    dtype or op object that is another object looks the plan up); ``flags.carray`` is
    C-contiguous, aligned and writeable in one read."""
    world = current()
    pg = world.default_group if group is None else group if type(group) is ProcessGroup else None
    shm = None if pg is None or world.default_group is None else pg.shm
    if shm is None:
        return False  # not initialized, no window, another group argument: the general path
    last = shm.plans.get(None)
    if last is not None and last[0] is arr.dtype and last[1] is op and last[2] == arr.shape:
        plan = last[3]
    else:
        if type(op) is not ReduceOp.RedOpType or shm.closed or resolve(group, "all_reduce") is not pg:
            return False  # (a destroyed group, a non-member: the general path raises or warns)
        key = (arr.dtype, arr.shape, op.name)
        plan = shm.plans.get(key)
        if plan is None:
            plan = _one_shot_plan(pg, arr, op)
        if not plan:
            return False
        shm.plans[None] = (arr.dtype, op, arr.shape, plan)
    if pg.queue or engine.recorder is not None or not arr.flags.carray:
        return False
    shm.all_reduce_one_shot(pg, pg.take_seq(), plan, arr)  # the context is built only if needed
    if plan.average:
        divide(arr, arr.dtype.name, pg.size())
    return True


def _one_shot_plan(pg, arr: np.ndarray, op):
    """The group's cached OneShot for ``arr``'s dtype and shape and ``op``, or False."""
    shm = pg.shm
    if len(shm.plans) >= 256:
        shm.plans.clear()
    key = (arr.dtype, arr.shape, op.name)
    shm.plans[key] = False
    if "all_reduce" in shm.tcp_only or op.name == "PREMUL_SUM":
        return False
    try:
        buf = as_buffer(arr, op="all_reduce")
        check_op(op, buf.dtype, "all_reduce")
    except (InvalidArgumentError, InvalidTensorError):
        return False  # the general path raises it
    plan = shm.one_shot_plan(arr.dtype, arr.shape, functools.partial(rows_into, op.name, buf.dtype),
                             fingerprint("all_reduce", buf.dtype, buf.numel, -1, op.name), op.name == "AVG")
    shm.plans[key] = plan or False
    return shm.plans[key]


def reduce(tensor, dst: int | None = None, op=ReduceOp.SUM, group=None, async_op: bool = False,
           group_dst: int | None = None, algorithm: str | None = None) -> Work | None:
    """Reduce ``tensor`` over all ranks into rank ``dst``'s ``tensor``; others keep theirs.

    rank 0: [1, 2]   rank 1: [3, 4]   --reduce(dst=1)-->   rank 0: [1, 2]   rank 1: [4, 6]
    """
    pg = member_group(group, "reduce")
    if pg is None:
        return not_member(async_op)
    root = root_rank(pg, dst, group_dst, "reduce", "dst")
    buf = writable(tensor, "reduce")
    combine, before, after = _reduction(buf, op, "reduce", pg.size())
    data = buf.array
    if pg.rank() != root:
        after = None  # non-roots keep their input unchanged
        if before is not None:  # PREMUL_SUM: scale a copy instead

            def before() -> None:
                scale(data, buf.dtype, op.factor)

            data = buf.array.copy()
    return run(pg, "reduce", dtype=buf.dtype, count=buf.numel, buffers={"data": data}, async_op=async_op,
               algorithm=algorithm, nbytes=buf.nbytes, root=root, reduce_op=op.name, combine=combine,
               before=before, after=after, result=[tensor], args={"count": buf.numel})


def barrier(group=None, async_op: bool = False, device_ids=None, algorithm: str | None = None) -> Work | None:
    """Block until every rank of ``group`` has called barrier (dissemination, ceil(log2 W)
    rounds of empty messages over the transport)."""
    pg = member_group(group, "barrier")
    if pg is None:
        return not_member(async_op)
    return run(pg, "barrier", dtype="bytes", count=0, buffers={"token": _TOKEN}, async_op=async_op,
               algorithm=algorithm, nbytes=0)


_TOKEN = np.empty(0, np.uint8)  # the barrier's messages carry no data


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout``.

    Every rank reports to group rank 0, which answers when all arrived.  If some do not
    arrive in time, rank 0 raises CommTimeoutError naming the first missing rank (all
    missing ranks with ``wait_all_ranks=True``), and the others raise because rank 0
    never released them.
    """
    pg = member_group(group, "monitored_barrier")
    if pg is None:
        return None
    limit = seconds(timeout)
    ctx = pg.next_context("monitored_barrier", _MB_FP, limit)
    token = memoryview(b"")
    t = pg.transport
    post = dict(kind=Kind.COLL, group=pg.id, expect=(ctx.seq, ctx.fingerprint))
    send = dict(kind=Kind.COLL, group=pg.id, seq=ctx.seq, fingerprint=ctx.fingerprint)
    if pg.rank() != 0:
        t.wait_all([t.isend(pg.members[0], token, tag=0, **send)], ctx.deadline, ctx.describe)
        t.wait_all([t.irecv(pg.members[0], memoryview(bytearray(0)), tag=1, **post)], ctx.deadline,
                   lambda: f"{ctx.describe()}: waiting for rank {pg.members[0]} to release the barrier")
        return None
    arrivals = {r: t.irecv(pg.members[r], memoryview(bytearray(0)), tag=0, **post) for r in range(1, pg.size())}
    for handle in arrivals.values():
        handle.wait(ctx.deadline)
    missing = [pg.members[r] for r, h in arrivals.items() if not h.done()]
    if missing:
        shown = missing if wait_all_ranks else missing[:1]
        raise CommTimeoutError(
            f"monitored_barrier (op #{ctx.seq} of group {pg.name}): rank(s) {shown} did not arrive within "
            f"{pg.timeout if limit is None else limit} s; they are hung, slow, or called another op")
    for h in arrivals.values():
        if h.error is not None:
            raise h.error
    t.wait_all([t.isend(pg.members[r], token, tag=1, **send) for r in range(1, pg.size())],
               ctx.deadline, ctx.describe)
    return None


_MB_FP = fingerprint("monitored_barrier")
