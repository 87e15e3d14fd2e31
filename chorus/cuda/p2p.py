"""Point-to-point of CUDA tensors on a group's CUDA component: sends and receives through
each pair's channel in the workspace (chorus.cuda.algorithms.exchange), or staged through
pinned host memory where the group has no workspace (chorus.cuda.staging).

    rank 0: batch(comp, [("send", t, 1, 0)], False)   # t goes to group rank 1, tag 0
    rank 1: batch(comp, [("recv", u, 0, 0)], False)   # u = rank 0's t

Sends and receives of a pair match in issue order and their tags must agree; a batch
moves its messages chunk by chunk, so no order of them deadlocks (batch_isend_irecv).
"""

from __future__ import annotations

from chorus.cuda import algorithms as A
from chorus.cuda import capture, staging
from chorus.engine import OpContext


def batch(comp, ops, async_op: bool):
    """Several sends and receives ((kind "send" or "recv", tensor, group rank of the peer,
    tag) each) of CUDA component ``comp`` (chorus.cuda.component) at once, enqueued on the
    caller's current stream; None, or (``async_op``) a Work done when all are."""
    pg = comp.pg
    if comp.lanes is None:
        works = [staging.p2p(pg, kind, t, peer, tag, True) for kind, t, peer, tag in ops]
        if not async_op:
            for w in works:
                w.wait()
            return None
        from chorus.cuda.work import AllWorks

        return AllWorks(works, [t for _, t, _, _ in ops])
    import torch

    kinds = {kind for kind, *_ in ops}
    if capture.capturing():
        capture.check("/".join(sorted(kinds)), "", pg.name)
    comp.check("/".join(sorted(kinds)))
    stream = torch.cuda.current_stream(comp.ws.device)
    what = ", ".join(f"{k} {'to' if k == 'send' else 'from'} rank {pg.members[p]} (tag {g})" for k, _, p, g in ops)
    op_id = comp.names.add(what)
    ctx = OpContext("send" if kinds == {"send"} else "recv" if kinds == {"recv"} else "p2p",
                    pg.id, -1, 0, pg.members, None)

    def message(t, peer, tag):
        return peer, t.data_ptr(), t.numel() * t.element_size(), tag

    def enqueue(run) -> None:
        with comp.lock:
            comp.lanes.begin(op_id, ctx, run.cuda_stream)
            A.exchange(comp.lanes, [message(t, p, g) for k, t, p, g in ops if k == "send"],
                       [message(t, p, g) for k, t, p, g in ops if k == "recv"], True)

    comp.launch_on(stream, enqueue)
    if not async_op:
        return None
    return comp.work_after(stream, what, [t for _, t, _, _ in ops], tuple(t for _, t, _, _ in ops))
