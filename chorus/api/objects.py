"""Object collectives: any picklable Python objects through the tensor collectives.

``broadcast_object_list``, ``all_gather_object``, ``gather_object``,
``scatter_object_list``, ``send_object_list``, ``recv_object_list`` keep
torch.distributed's contracts: the lists you pass are filled in place, on every rank
that receives.  Each call moves two messages: the pickled sizes (``int64``), then the
pickled bytes (``uint8``; padded to the largest object where the collective needs
equal blocks).  They are synchronous and meant for small control data (configs,
metrics, strings); move tensors with the tensor collectives.

    rank 0: objs = ["foo", 12, {1: 2}]   rank 1: objs = [None, None, None]
    broadcast_object_list(objs, src=0)   ->   rank 1: objs = ["foo", 12, {1: 2}]

.. warning:: Security.  The objects travel pickled, and unpickling runs whatever code
   the bytes ask for.  So a receiver unpickles anything only from peers that proved the
   job token in the connection handshake (``chorusrun`` and ``chorus.spawn`` generate
   one, a job whose ranks share one host derives one: ``chorus.host.secret``; give
   multi-host jobs ``--token-file``/``CHORUS_TOKEN``).  In a job without a
   token it accepts only safe globals: builtin containers and scalars, datetime,
   Decimal, Fraction, numpy arrays, torch tensors, dtypes, devices and sizes, and what
   ``chorus.add_safe_globals([...])`` registered; any other global raises
   ``UnsafeObjectError`` naming it, and nothing of the object runs.
   ``CHORUS_OBJECT_PICKLE=safe|full`` chooses either way (``chorus.api.safe_pickle``).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from chorus.api.calls import member_group, root_rank
from chorus.api.collectives import broadcast
from chorus.api.gathering import all_gather_into_tensor, gather, scatter
from chorus.api.p2p import recv, send
from chorus.api.safe_pickle import ObjectDecoder
from chorus.errors import BufferMismatchError, CollectiveMismatchError, InvalidArgumentError


def _pickled(obj: Any) -> np.ndarray:
    """``obj`` pickled, as a ``uint8`` array."""
    return np.frombuffer(pickle.dumps(obj), dtype=np.uint8)


def _decoder(pg, op: str) -> ObjectDecoder:
    """How this call unpickles: anything only if the peers proved the job token."""
    return ObjectDecoder(op, pg.transport.authenticated)


def _concat(blobs: list[np.ndarray]) -> np.ndarray:
    """The blobs back to back, in a new writable array."""
    return np.concatenate(blobs) if blobs else np.empty(0, np.uint8)


def _pickle_each(objects: list) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each object's pickled size (``int64``: the first message) and its pickle."""
    blobs = [_pickled(obj) for obj in objects]
    return np.array([b.size for b in blobs], np.int64), blobs


def _unpickle_each(decode: ObjectDecoder, blocks, sizes: np.ndarray, senders) -> list[Any]:
    """Unpickle ``blocks[i][:sizes[i]]``, sent by global rank ``senders[i]``, for every i:
    padded rows, or a payload's pieces."""
    return [decode(memoryview(block[:size]), sender)
            for block, size, sender in zip(blocks, sizes, senders, strict=True)]


def _split(decode: ObjectDecoder, payload: np.ndarray, sizes: np.ndarray, sender: int) -> list[Any]:
    """Unpickle the back-to-back objects of ``payload`` whose lengths are ``sizes``."""
    return _unpickle_each(decode, (payload[start:] for start in np.cumsum(sizes) - sizes), sizes,
                          [sender] * len(sizes))


def _sizes_and_row(obj: Any, group, world: int) -> tuple[np.ndarray, np.ndarray]:
    """All-gather every group rank's pickled size (the first message); return the sizes and
    ``obj`` pickled and zero-padded to the widest (this rank's block of the second)."""
    blob = _pickled(obj)
    sizes = np.zeros(world, np.int64)
    all_gather_into_tensor(sizes, np.array([blob.size], np.int64), group=group)
    return sizes, _padded([blob], int(sizes.max()))[0]


def _padded(blobs: list[np.ndarray], width: int) -> np.ndarray:
    """A (len(blobs), width) array holding one blob per row, zero-padded."""
    rows = np.zeros((len(blobs), width), np.uint8)
    for row, blob in zip(rows, blobs, strict=True):
        row[:blob.size] = blob
    return rows


def _check_list(obj: Any, op: str, what: str, length: int | None = None) -> None:
    """``obj`` must be a list (it is filled in place), of ``length`` entries if given."""
    if not isinstance(obj, list):
        raise InvalidArgumentError(
            f"{op}: {what} must be a list (it is filled in place), got {type(obj).__name__}")
    if length is not None and len(obj) != length:
        raise InvalidArgumentError(
            f"{op}: {what} must have one entry per rank of the group ({length}), got {len(obj)}")


def broadcast_object_list(object_list: list, src: int | None = None, group=None, device=None,
                          group_src: int | None = None) -> None:
    """Copy the objects of rank ``src``'s ``object_list`` into every rank's ``object_list``.

    rank 0: ["foo", 12, {1: 2}]   rank 1: [None, None, None]   --src=0-->   both: ["foo", 12, {1: 2}]

    Every rank passes a list of the same length; ``device`` is accepted for torch
    compatibility and ignored (chorus moves CPU memory).

    .. warning:: The objects travel pickled.  Without a job token only safe globals are
       unpickled (``chorus.add_safe_globals``; see the module docstring).
    """
    op = "broadcast_object_list"
    pg = member_group(group, op)
    if pg is None:
        return None
    _check_list(object_list, op, "object_list")
    root = root_rank(pg, src, group_src, op, "src")
    if pg.rank() == root:
        sizes, blobs = _pickle_each(object_list)
    else:
        sizes = np.zeros(len(object_list), np.int64)
    try:
        broadcast(sizes, group=group, group_src=root)
    except CollectiveMismatchError as exc:
        raise CollectiveMismatchError(
            f"{op}: object_list must have the same length on every rank (this rank passed "
            f"{len(object_list)} entries); {exc}") from exc
    total = int(sizes.sum())
    if total == 0:  # empty lists: nothing more to move
        return None
    payload = _concat(blobs) if pg.rank() == root else np.empty(total, np.uint8)
    broadcast(payload, group=group, group_src=root)
    if pg.rank() != root:
        object_list[:] = _split(_decoder(pg, op), payload, sizes, pg.members[root])
    return None


def all_gather_object(object_list: list, obj: Any, group=None) -> None:
    """Every rank gets every rank's ``obj``: ``object_list[i]`` = group rank i's ``obj``.

    rank 0: obj="foo"   rank 1: obj=12   -->   both: object_list = ["foo", 12]

    ``object_list`` must have one entry per rank of the group.

    .. warning:: The objects travel pickled.  Without a job token only safe globals are
       unpickled (``chorus.add_safe_globals``; see the module docstring).
    """
    op = "all_gather_object"
    pg = member_group(group, op)
    if pg is None:
        return None
    world = pg.size()
    _check_list(object_list, op, "object_list", world)
    sizes, mine = _sizes_and_row(obj, group, world)
    rows = np.empty((world, mine.size), np.uint8)
    all_gather_into_tensor(rows, mine, group=group)
    object_list[:] = _unpickle_each(_decoder(pg, op), rows, sizes, pg.members)
    return None


def gather_object(obj: Any, object_gather_list: list | None = None, dst: int | None = None, group=None,
                  group_dst: int | None = None) -> None:
    """Rank ``dst`` gets every rank's ``obj`` in ``object_gather_list`` (others pass None).

    rank 0: obj="foo"   rank 1: obj=12   --dst=0-->   rank 0: object_gather_list = ["foo", 12]

    .. warning:: The objects travel pickled.  Without a job token only safe globals are
       unpickled (``chorus.add_safe_globals``; see the module docstring).
    """
    op = "gather_object"
    pg = member_group(group, op)
    if pg is None:
        return None
    root = root_rank(pg, dst, group_dst, op, "dst")
    world = pg.size()
    if pg.rank() == root:
        _check_list(object_gather_list, op, "object_gather_list", world)
    elif object_gather_list:
        raise InvalidArgumentError(
            f"{op}: object_gather_list must be None on ranks other than dst (group rank {root}); "
            "only dst receives the objects")
    sizes, mine = _sizes_and_row(obj, group, world)  # every rank pads to the widest object
    if pg.rank() != root:
        gather(mine, None, group=group, group_dst=root)
        return None
    rows = np.empty((world, mine.size), np.uint8)
    gather(mine, list(rows), group=group, group_dst=root)
    object_gather_list[:] = _unpickle_each(_decoder(pg, op), rows, sizes, pg.members)
    return None


def scatter_object_list(scatter_object_output_list: list, scatter_object_input_list: list | None = None,
                        src: int | None = None, group=None, group_src: int | None = None) -> None:
    """Group rank i gets ``scatter_object_input_list[i]`` of rank ``src`` in
    ``scatter_object_output_list[0]``; the input list is only read on ``src``.

    rank 0: input = ["foo", 12]   --src=0-->   rank 0: output[0] = "foo"   rank 1: output[0] = 12

    .. warning:: The objects travel pickled.  Without a job token only safe globals are
       unpickled (``chorus.add_safe_globals``; see the module docstring).
    """
    op = "scatter_object_list"
    pg = member_group(group, op)
    if pg is None:
        return None
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise InvalidArgumentError(
            f"{op}: scatter_object_output_list must be a list of at least one entry (entry 0 receives "
            f"this rank's object), got {scatter_object_output_list!r}")
    root = root_rank(pg, src, group_src, op, "src")
    world = pg.size()
    if pg.rank() == root:
        _check_list(scatter_object_input_list, op, "scatter_object_input_list", world)
        sizes, blobs = _pickle_each(scatter_object_input_list)
    else:
        sizes = np.zeros(world, np.int64)
    broadcast(sizes, group=group, group_src=root)  # everyone learns the block width
    width = int(sizes.max())
    mine = np.empty(width, np.uint8)
    blocks = list(_padded(blobs, width)) if pg.rank() == root else None
    scatter(mine, blocks, group=group, group_src=root)
    scatter_object_output_list[0] = _decoder(pg, op)(memoryview(mine[:sizes[pg.rank()]]), pg.members[root])
    return None


def send_object_list(object_list: list, dst: int | None = None, group=None, device=None,
                     group_dst: int | None = None) -> None:
    """Send the objects of ``object_list`` to rank ``dst``, which calls ``recv_object_list``
    with a list of the same length.

    rank 0: send_object_list(["foo", 12], dst=1)   rank 1: recv_object_list(objs, src=0) -> ["foo", 12]

    ``device`` is accepted for torch compatibility and ignored.

    .. warning:: The objects travel pickled.  Without a job token only safe globals are
       unpickled (``chorus.add_safe_globals``; see the module docstring).
    """
    op = "send_object_list"
    if member_group(group, op) is None:
        return None
    _check_list(object_list, op, "object_list")
    sizes, blobs = _pickle_each(object_list)
    send(sizes, dst=dst, group=group, group_dst=group_dst)
    if blobs:
        send(_concat(blobs), dst=dst, group=group, group_dst=group_dst)
    return None


def recv_object_list(object_list: list, src: int | None = None, group=None, device=None,
                     group_src: int | None = None) -> int:
    """Receive the objects a ``send_object_list`` sent, into ``object_list`` (same length).

    Returns the sender's global rank (as torch does), or -1 if this rank is not in
    ``group``.  ``src=None`` (and no ``group_src``) receives from any rank; both messages
    then come from the rank that sent the first.  ``device`` is ignored.

    .. warning:: The objects travel pickled.  Without a job token only safe globals are
       unpickled (``chorus.add_safe_globals``; see the module docstring).
    """
    op = "recv_object_list"
    pg = member_group(group, op)
    if pg is None:
        return -1
    _check_list(object_list, op, "object_list")
    sizes = np.zeros(len(object_list), np.int64)
    try:
        sender = recv(sizes, src=src, group=group, group_src=group_src)
    except BufferMismatchError as exc:
        raise BufferMismatchError(
            f"{op}: object_list has {len(object_list)} entries but the sender sent a different number "
            f"of objects; sender and receiver must pass lists of the same length ({exc})") from exc
    if group_src is not None:  # chorus's recv answers with the group rank then
        sender = pg.members[group_src]
    if object_list:
        payload = np.empty(int(sizes.sum()), np.uint8)
        recv(payload, src=sender, group=group)
        object_list[:] = _split(_decoder(pg, op), payload, sizes, sender)
    return sender
