"""Reducing and rooted collectives: ``broadcast``, ``all_reduce``, ``reduce``, ``barrier``,
``monitored_barrier``.  Signatures and semantics are torch.distributed's; every one also
takes chorus's ``algorithm=`` keyword (see chorus.selection)."""

from __future__ import annotations

import numpy as np

from chorus.api.calls import (
    collective,
    device_lane,
    lane,
    member_group,
    not_member,
    root_rank,
    writable,
)
from chorus.buffers import clone, is_torch_tensor
from chorus.errors import CommTimeoutError, PeerLostError
from chorus.reductions import ReduceOp, check_op, combiner, divide, scale
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
    return collective(pg, "broadcast", dtype=buf.dtype, count=buf.numel, buffers={"data": buf.array},
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
    if algorithm is None:
        window = None if async_op else lane(group)
        if type(tensor) is np.ndarray:
            if window is not None and window.all_reduce_now(tensor, op):
                return None
        elif window is not None and (held := window.held_tensor_now(tensor, op)) is not None:
            if held:  # the last call's small CPU tensor again: no type or device checks
                return None
        elif is_torch_tensor(tensor):
            if tensor.is_cuda:  # (async too: a CUDA op is queued on the stream either way)
                gpu = device_lane(group, "cuda")
                done = gpu is not None and gpu.all_reduce_now(tensor, op, async_op)
                if done:
                    return done if async_op else None
            elif window is not None and window.all_reduce_tensor_now(tensor, op):
                return None  # (a tensor of another device: numpy has no view of it, the lane steps aside)
    return all_reduce_general(tensor, op, group, async_op, algorithm)


def all_reduce_general(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False,
                       algorithm: str | None = None) -> Work | None:
    """all_reduce as a Call on the general path, for a caller that asked the lanes already
    (chorus.torch's CUDA all_reduce)."""
    pg = member_group(group, "all_reduce")
    if pg is None:
        return not_member(async_op)
    buf = writable(tensor, "all_reduce")
    combine, before, after = _reduction(buf, op, "all_reduce", pg.size())
    return collective(pg, "all_reduce", dtype=buf.dtype, count=buf.numel, buffers={"data": buf.array},
               async_op=async_op, algorithm=algorithm, nbytes=buf.nbytes, reduce_op=op.name,
               combine=combine, before=before, after=after, result=[tensor], args={"count": buf.numel})


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

            data = clone(buf.array)
    return collective(pg, "reduce", dtype=buf.dtype, count=buf.numel, buffers={"data": data}, async_op=async_op,
               algorithm=algorithm, nbytes=buf.nbytes, root=root, reduce_op=op.name, combine=combine,
               before=before, after=after, result=[tensor], args={"count": buf.numel})


def barrier(group=None, async_op: bool = False, device_ids=None, algorithm: str | None = None) -> Work | None:
    """Block until every rank of ``group`` has called barrier (dissemination, ceil(log2 W)
    rounds of empty messages over the transport).

    rank 0: barrier() at t = 1 s   rank 1: barrier() at t = 3 s   ->   both return at t = 3 s
    """
    pg = member_group(group, "barrier")
    if pg is None:
        return not_member(async_op)
    return collective(pg, "barrier", dtype="bytes", count=0, buffers={"token": _TOKEN}, async_op=async_op,
               algorithm=algorithm, nbytes=0)


_TOKEN = np.empty(0, np.uint8)  # the barrier's messages carry no data


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout``.

    Every rank reports to group rank 0, which answers when all arrived.  The errors use
    gloo's words, so code that matches them keeps working (ranks are global ranks)::

        rank 0, rank 1 missing:   CommTimeoutError "Rank 1 failed to pass monitoredBarrier in 2000 ms ..."
          (wait_all_ranks=True)   CommTimeoutError "Ranks 1, 2 failed to pass monitoredBarrier in 2000 ms ..."
        rank 0, timeout <= 0:     CommTimeoutError "Rank 0 timed out in monitoredBarrier after 0 ms ..."
        rank 1, never released:   "Rank 1 successfully reached monitoredBarrier, but received
                                  errors while waiting for send/recv from rank 0 ..." (the
                                  CommTimeoutError or PeerLostError it got)
    """
    pg = member_group(group, "monitored_barrier")
    if pg is None:
        return None
    limit = seconds(timeout)
    ctx = pg.next_context("monitored_barrier", _MB_FP, limit)
    allowed_ms = round(1000 * (pg.timeout if limit is None else limit))
    token = memoryview(b"")
    t = pg.transport
    post = dict(kind=Kind.COLL, group=pg.id, expect=(ctx.seq, ctx.fingerprint))
    send = dict(kind=Kind.COLL, group=pg.id, seq=ctx.seq, fingerprint=ctx.fingerprint)
    root = pg.members[0]
    if pg.rank() != 0:
        try:
            t.wait_all([t.isend(root, token, tag=0, **send)], ctx.deadline, ctx.describe, label=ctx.label)
            t.wait_all([t.irecv(root, memoryview(bytearray(0)), tag=1, **post)], ctx.deadline,
                       lambda: f"{ctx.describe()}: waiting for rank {root} to release the barrier",
                       label=ctx.label)
        except (CommTimeoutError, PeerLostError) as exc:
            raise _unreleased(exc, pg.members[pg.rank()], root) from exc
        return None
    arrivals = {r: t.irecv(pg.members[r], memoryview(bytearray(0)), tag=0, **post) for r in range(1, pg.size())}
    if allowed_ms <= 0 and arrivals:
        raise CommTimeoutError(
            f"Rank {root} timed out in monitoredBarrier after {allowed_ms} ms (op #{ctx.seq} of group "
            f"{pg.name}): no time left to wait for ranks {list(pg.members[1:])}; pass a positive timeout")
    waiting = list(arrivals.values())
    for handle in waiting:
        if not handle.done():
            t.wait_long(handle, waiting, ctx.deadline, ctx.label)  # reports who is missing meanwhile
        handle.wait(ctx.deadline)
    missing = [pg.members[r] for r, h in arrivals.items() if not h.done()]
    if missing:
        shown = missing if wait_all_ranks else missing[:1]
        who = f"Ranks {', '.join(map(str, shown))}" if len(shown) > 1 else f"Rank {shown[0]}"
        raise CommTimeoutError(
            f"{who} failed to pass monitoredBarrier in {allowed_ms} ms (op #{ctx.seq} of group {pg.name}); "
            "they are hung, slow, or called another op")
    for h in arrivals.values():
        if h.error is not None:
            raise h.error
    t.wait_all([t.isend(pg.members[r], token, tag=1, **send) for r in range(1, pg.size())],
               ctx.deadline, ctx.describe, label=ctx.label)
    return None


def _unreleased(exc: CommTimeoutError | PeerLostError, me: int, root: int) -> CommTimeoutError | PeerLostError:
    """What a rank that reached the monitored barrier raises when its root never released it."""
    message = (f"Rank {me} successfully reached monitoredBarrier, but received errors while waiting for "
               f"send/recv from rank {root}. Rank {root}'s error names the faulty rank. ({exc})")
    if isinstance(exc, PeerLostError):
        return PeerLostError(message, exc.lost_rank, exc.reporter)
    return CommTimeoutError(message)


_MB_FP = fingerprint("monitored_barrier")
