"""Point-to-point: ``send``, ``recv``, ``isend``, ``irecv``, ``P2POp``, ``batch_isend_irecv``.

Peers are global ranks (``dst``/``src``) or ranks within ``group`` (``group_dst`` /
``group_src``), exactly one of the two.  Messages between two ranks with the same group
and tag arrive in the order they were sent; different tags are separate streams.

CUDA tensors go through the group's CUDA component (chorus.cuda) with NCCL's semantics:
sends and receives between two ranks match in issue order, they are enqueued on the
caller's current stream, and ``batch_isend_irecv`` runs its ops as one group (as NCCL's
grouped calls), so a batch that sends to and receives from the same peer cannot deadlock.
A receive from any source is not possible on CUDA tensors (nor on NCCL).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chorus.api.groups import resolve, warn_not_in_group
from chorus.buffers import Buffer, as_buffer
from chorus.components.select import device_component
from chorus.errors import InvalidArgumentError
from chorus.process_group import ProcessGroup
from chorus.work import CompletedWork, HandleWork, Work


def _peer(pg: ProcessGroup, peer: int | None, group_peer: int | None, op: str, name: str,
          allow_any: bool = False) -> int | None:
    """Validate and return the peer's *group* rank (None = any source)."""
    if peer is not None and group_peer is not None:
        raise InvalidArgumentError(f"{op}: pass either {name}= or group_{name}=, not both")
    if peer is None and group_peer is None:
        if allow_any:
            return None
        raise InvalidArgumentError(f"{op}: {name}= (global rank) or group_{name}= (rank in group) is required")
    if group_peer is not None:
        g = pg.global_rank(group_peer, op=op, what=f"group_{name}")
    else:
        g = pg.members[pg.group_rank(peer, op=op, what=name)]
    if g == pg.members[pg.rank()]:
        raise InvalidArgumentError(
            f"{op}: {name} rank {g} is this rank itself; point-to-point needs another rank "
            "(torch.distributed forbids sending to or receiving from yourself too)"
        )
    return pg.group_rank(g)


def _check_tag(tag: Any, op: str) -> int:
    if not isinstance(tag, int) or isinstance(tag, bool) or not -(1 << 63) <= tag < (1 << 63):
        raise InvalidArgumentError(f"{op}: tag must be a 64-bit int, got {tag!r}")
    return tag


def _recv_buffer(tensor: Any, op: str) -> Buffer:
    buf = as_buffer(tensor, op=op, what="receive buffer")
    if not buf.writable:
        raise InvalidArgumentError(f"{op}: the receive buffer is read-only; pass a writable array")
    return buf


class _Posted:
    """A posted send or receive: its group, group peer (None: any source), tag, handle
    and buffer."""

    __slots__ = ("pg", "peer", "tag", "handle", "buf")

    def __init__(self, pg: ProcessGroup, peer: int | None, tag: int, handle, buf: Buffer):
        self.pg, self.peer, self.tag, self.handle, self.buf = pg, peer, tag, handle, buf

    def work(self, op: str, direction: str, tensor, finish: Callable[[], None] | None = None) -> HandleWork:
        pg = self.pg
        return HandleWork(pg.transport, [self.handle], pg.deadline(),
                          _describer(op, direction, pg, self.peer, self.tag), finish=finish, result=[tensor],
                          label=_labeller(op, self.tag))


class _OnDevice:
    """A send or receive of a CUDA tensor, validated, not yet enqueued: ``kind`` ("send"
    or "recv"), group, group peer, tag, buffer."""

    __slots__ = ("kind", "pg", "peer", "tag", "buf")

    def __init__(self, kind: str, pg: ProcessGroup, peer: int, tag: int, buf: Buffer):
        self.kind, self.pg, self.peer, self.tag, self.buf = kind, pg, peer, tag, buf

    def entry(self) -> tuple:
        return (self.kind, self.buf.array, self.peer, self.tag)


def _enqueue(ops: list[_OnDevice], async_op: bool) -> Work | None:
    """Enqueue CUDA sends/receives of one group as one grouped launch on its CUDA component."""
    pg = ops[0].pg
    if any(o.pg is not pg for o in ops):
        raise InvalidArgumentError("batch_isend_irecv: CUDA ops of one batch must use one group")
    component = device_component(pg, ops[0].buf.device)
    work = component.p2p_batch([o.entry() for o in ops], async_op)
    for o in ops:  # copies back into non-contiguous receive buffers, queued after the op
        if o.kind == "recv":
            o.buf.finish()
    return work


def _post_send(tensor, dst, group, tag, group_dst, op: str, sync: bool) -> _Posted | _OnDevice | None:
    pg = resolve(group, op)
    if pg is None:
        warn_not_in_group(op)
        return None
    tag = _check_tag(tag, op)
    peer = _peer(pg, dst, group_dst, op, "dst")
    buf = as_buffer(tensor, op=op)
    if buf.device != "cpu":
        return _OnDevice("send", pg, peer, tag, buf)
    return _Posted(pg, peer, tag, pg.post_send(buf.bytes_view(), peer, tag, buf.dtype_code, sync), buf)


def _post_recv(tensor, src, group, tag, group_src, op: str) -> _Posted | _OnDevice | None:
    pg = resolve(group, op)
    if pg is None:
        warn_not_in_group(op)
        return None
    tag = _check_tag(tag, op)
    peer = _peer(pg, src, group_src, op, "src", allow_any=True)
    buf = _recv_buffer(tensor, op)
    if buf.device != "cpu":
        if peer is None:
            raise InvalidArgumentError(f"{op}: a CUDA tensor needs src= (a receive from any rank is "
                                       "not possible on GPUs, as with NCCL)")
        return _OnDevice("recv", pg, peer, tag, buf)
    view = buf.bytes_view()
    # A small receive from one peer is read by the thread that waits for its Work
    # (Transport.WAITER_READS_MAX).  Not from any source (a waiting thread cannot read
    # every connection), nor under rendezvous sends, whose sender waits for this rank to
    # read the frame while this rank may be waiting on something else first.
    waited = op == "recv" or (peer is not None and not pg.rendezvous
                              and len(view) <= pg.transport.WAITER_READS_MAX)
    return _Posted(pg, peer, tag, pg.post_recv(view, peer, tag, buf.dtype_code, waited), buf)


def _describer(op: str, direction: str, pg: ProcessGroup, peer: int | None, tag: int) -> Callable[[], str]:
    def describe() -> str:
        who = "any rank" if peer is None else f"rank {pg.members[peer]}"
        return f"{op} {direction} {who} (tag {tag}, group {pg.name})"
    return describe


def _labeller(op: str, tag: int) -> Callable[[], str]:
    return lambda: f"{op} (tag {tag})"


def send(tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None) -> None:
    """Send ``tensor`` to rank ``dst``; returns when the data is on its way (with
    ``CHORUS_SEND_MODE=rendezvous``: once ``dst`` has posted the matching receive, as
    torch's blocking send does).

    rank 0: send(t, dst=1)        rank 1: recv(t, src=0)  ->  t holds rank 0's data
    """
    posted = _post_send(tensor, dst, group, tag, group_dst, "send", sync=True)
    if posted is None:
        return
    if type(posted) is _OnDevice:
        _enqueue([posted], False)
        return
    h = posted.handle
    if not h.done() or h.error is not None:  # the data is not out yet, or it failed: wait, report
        posted.work("send", "to", tensor).wait()


def recv(tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None) -> int:
    """Receive into ``tensor`` from ``src`` (None = from any rank); returns the sender's
    global rank (also when ``group_src`` was given, as torch 2.13 does); -1 if not in ``group``.

    rank 0: send(t, dst=1)   rank 2: send(u, dst=1)
    rank 1: recv(x) -> 0 or 2, x holds that rank's data; recv(x) again -> the other one
    """
    posted = _post_recv(tensor, src, group, tag, group_src, "recv")
    if posted is None:
        return -1
    if type(posted) is _OnDevice:
        _enqueue([posted], False)
        return posted.pg.members[posted.peer]
    pg, h = posted.pg, posted.handle  # what HandleWork.wait does, without building one
    pg.transport.wait_all([h], pg.deadline(), _describer("recv", "from", pg, posted.peer, posted.tag),
                          label=_labeller("recv", posted.tag))
    posted.buf.finish()
    return h.peer


def isend(tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None) -> Work | None:
    """Start sending ``tensor`` to ``dst``; returns a Work (do not modify ``tensor`` until
    ``wait()`` returns).  None if this rank is not in ``group``.

    rank 0: w = isend(t, dst=1); ...; w.wait()   rank 1: w = irecv(t, src=0); ...; w.wait()
      -> rank 1's t holds rank 0's data once its wait() returns
    """
    posted = _post_send(tensor, dst, group, tag, group_dst, "isend", sync=False)
    if type(posted) is _OnDevice:
        return _enqueue([posted], True)
    return None if posted is None else posted.work("isend", "to", tensor)


def irecv(tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None) -> Work | None:
    """Start receiving into ``tensor``; returns a Work (``wait()``, then read ``tensor``).

    rank 0: isend(t, dst=1).wait()   rank 1: w = irecv(x, src=0); w.wait() -> x == rank 0's t

    A CPU receive of up to 64 KiB from one peer is read by the thread that waits for it, as
    MPI progresses on its calls: its message may stay in the socket until ``wait()``,
    ``is_completed()`` or ``get_future()`` (at most about 50 ms after this rank last read
    from that peer); larger ones, and any from any source, complete in the background.
    """
    posted = _post_recv(tensor, src, group, tag, group_src, "irecv")
    if type(posted) is _OnDevice:
        return _enqueue([posted], True)
    return None if posted is None else posted.work("irecv", "from", tensor, posted.buf.finish)


class P2POp:
    """One send or receive of a ``batch_isend_irecv`` batch: ``P2POp(isend, t, peer)``."""

    def __init__(self, op: Callable, tensor, peer: int | None = None, group=None, tag: int = 0,
                 group_peer: int | None = None):
        if op not in (isend, irecv):
            raise InvalidArgumentError("P2POp: op must be chorus.isend or chorus.irecv")
        if peer is None and group_peer is None:
            raise InvalidArgumentError("P2POp: peer= or group_peer= is required")
        self.op, self.tensor, self.peer, self.group, self.tag, self.group_peer = op, tensor, peer, group, tag, group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Post every op of the list (receives first) and return their Works in list order.

    A ring of W ranks, each sending to the next and receiving from the previous:
    rank r: works = batch_isend_irecv([P2POp(isend, mine, (r + 1) % W), P2POp(irecv, theirs, (r - 1) % W)])
            for w in works: w.wait()   ->   theirs holds rank (r - 1) % W's mine
    """
    if not isinstance(p2p_op_list, (list, tuple)) or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise InvalidArgumentError("batch_isend_irecv: expects a list of P2POp")
    if p2p_op_list and _on_cuda(p2p_op_list[0].tensor):
        return _batch_on_device(p2p_op_list)
    works: dict[int, Work | None] = {}
    for phase in (irecv, isend):
        for i, p in enumerate(p2p_op_list):
            if p.op is phase:
                if p.op is isend:
                    works[i] = isend(p.tensor, p.peer, p.group, p.tag, None if p.peer is not None else p.group_peer)
                else:
                    works[i] = irecv(p.tensor, p.peer, p.group, p.tag, None if p.peer is not None else p.group_peer)
    return [works[i] if works[i] is not None else CompletedWork() for i in range(len(p2p_op_list))]


def _on_cuda(tensor) -> bool:
    device = getattr(tensor, "device", None)
    return device is not None and getattr(device, "type", "cpu") == "cuda"


def _batch_on_device(p2p_op_list: list[P2POp]) -> list[Work]:
    """A batch of CUDA sends and receives: validated, then enqueued as one group; every op
    of the batch gets the batch's Work (as torch's NCCL backend does)."""
    posted = []
    for p in p2p_op_list:
        group_peer = None if p.peer is not None else p.group_peer
        if p.op is isend:
            one = _post_send(p.tensor, p.peer, p.group, p.tag, group_peer, "batch_isend_irecv", sync=False)
        else:
            one = _post_recv(p.tensor, p.peer, p.group, p.tag, group_peer, "batch_isend_irecv")
        if one is not None and type(one) is not _OnDevice:
            raise InvalidArgumentError("batch_isend_irecv: CPU and CUDA tensors in one batch; use one device")
        posted.append(one)
    mine = [o for o in posted if o is not None]
    if not mine:
        return [CompletedWork() for _ in p2p_op_list]
    work = _enqueue(mine, True)
    return [work if o is not None else CompletedWork() for o in posted]
