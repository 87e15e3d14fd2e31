"""What went wrong on a group's GPUs, in words: chorus.cuda's kernels report a failure by
writing numbers into the host control page (chorus.cuda.layout: STATUS, FAIL_OP,
FAIL_WHAT, FAIL_PEERS, FAIL_FP, the TAG_* words); these turn them, with the transport's
state, into the error the caller sees, naming the op, the group, the ranks and the fix.

``OpNames`` keeps what each op id the kernels report stands for:

    names = OpNames("g3")
    op_id = names.add(None, seq=7, fprint=fp, name="all_reduce")   # -> 1
    names.entry(op_id)          # ("all_reduce (op #7 of group g3)", 7, fp)
    names.replayed(epoch=40, op_id=op_id)   # a replayed kernel reports L.REPLAY_OP + 40
    names.entry(L.REPLAY_OP + 40)           # the same entry
"""

from __future__ import annotations

import itertools

from chorus.cuda import layout as L
from chorus.cuda.algorithms import EXCHANGE_TAG
from chorus.errors import (
    AbortedError,
    BufferMismatchError,
    CollectiveMismatchError,
    CommTimeoutError,
    InvalidArgumentError,
    PeerLostError,
)
from chorus.wire.fingerprint import describe

#: op descriptions kept for error messages
KEPT = 4096
_U64 = (1 << 64) - 1


class OpNames:
    """The ops a group's CUDA component enqueued, by the id its kernels report."""

    def __init__(self, group: str = ""):
        self.group = group
        # op id % KEPT -> (op id, description or None, seq, fingerprint, name): a ring, as
        # ids only grow (a dict trimmed from its front makes next(iter()) walk the holes
        # the deletions left: microseconds per op)
        self.ops: list[tuple | None] = [None] * KEPT
        self.last = 0
        self._ids = itertools.count(1)  # (next() is one step under the GIL: p2p may add from another thread)
        # epoch % KEPT -> (epoch, op id) of the ops a lane replayed (chorus.cuda.replays)
        self.epochs: list[tuple[int, int] | None] = [None] * KEPT

    def add(self, description: str | None, seq: int = -1, fprint: int = 0, name: str = "") -> int:
        """An id for the op being enqueued; ``description`` None: the collective
        ``name``'s, written out only when an error needs it."""
        op_id = self.last = next(self._ids)
        self.ops[op_id % KEPT] = (op_id, description, seq, fprint, name)
        return op_id

    def add_replayed(self, epoch: int, seq: int, fprint: int, name: str) -> None:
        """add() and replayed() in one step, for a collective ``name`` whose replayed
        kernel's first epoch is ``epoch`` (the lane's steady state: chorus.cuda.lanes)."""
        op_id = self.last = next(self._ids)
        self.ops[op_id % KEPT] = (op_id, None, seq, fprint, name)
        self.epochs[epoch % KEPT] = (epoch, op_id)

    def replayed(self, epoch: int, op_id: int) -> None:
        """Op ``op_id`` runs as a replayed kernel whose first epoch is ``epoch``: the id
        it reports is L.REPLAY_OP + ``epoch``."""
        self.epochs[epoch % KEPT] = (epoch, op_id)

    def entry(self, op_id: int):
        """(description, seq, fingerprint) of op ``op_id``, or None (unknown, or one of the
        KEPT ops before the last KEPT)."""
        if op_id >= L.REPLAY_OP:
            epoch = op_id - L.REPLAY_OP
            known = self.epochs[epoch % KEPT]
            op_id = known[1] if known is not None and known[0] == epoch else 0
        entry = self.ops[op_id % KEPT] if op_id > 0 else None
        if entry is None or entry[0] != op_id:
            return None
        _, description, seq, fprint, name = entry
        if description is None:
            description = f"{name} (op #{seq} of group {self.group})"
        return description, seq, fprint

    def described(self, op_id: int, otherwise: str) -> str:
        entry = self.entry(op_id)
        return entry[0] if entry is not None else otherwise


def _tag(tag: int) -> str:
    return "(all_to_all)" if tag == EXCHANGE_TAG else str(tag)


def tag_mismatch(pg, names: OpNames, words) -> InvalidArgumentError:
    """A receive found its sender's message under another tag (not fatal: the word is
    cleared, the group goes on)."""
    op = names.described(int(words[L.TAG_OP]) - 1, "a receive")
    peer = pg.members[int(words[L.TAG_PEER])]
    expect, got = (_tag(int(words[i])) for i in (L.TAG_EXPECT, L.TAG_GOT))
    words[L.TAG_OP] = 0
    return InvalidArgumentError(
        f"{op} on group {pg.name}: this rank expected tag {expect} but rank {peer}'s matching "
        f"send has tag {got}; sends and receives between two ranks match in issue order, so "
        "post them in the same order on both sides with the same tags")


def error(pg, names: OpNames, what: str, words) -> BaseException:
    """The error of group ``pg`` (``what``: the call that finds it): the transport's when
    it knows of one (a lost peer, a mismatch), else the control page's."""
    status = int(words[L.STATUS])
    if status == L.MISMATCH:
        return mismatch(pg, names, words)
    description, seq, fprint = names.entry(int(words[L.FAIL_OP])) or ("an earlier op", -1, 0)
    op = description if status else "an op"
    expect = (seq, fprint) if status and fprint else None  # names this rank's call in a mismatch
    lost = pg.transport.failure(pg.id, None, expect=expect)
    bits = int(words[L.FAIL_PEERS])
    ranks = [pg.members[r] for r in range(bits.bit_length()) if bits >> r & 1]
    waited = {L.WAIT_BARRIER: "arrive at its barrier", L.WAIT_READY: "send its data",
              L.WAIT_ACK: "take the previous data out of this rank's channel"}.get(int(words[L.FAIL_WHAT]), "")
    where = f"{what} on group {pg.name} (CUDA)"
    if lost is not None:
        if isinstance(lost, PeerLostError):
            return PeerLostError(f"{where}: {lost}", lost.lost_rank, lost.reporter)
        return type(lost)(f"{where}: {lost}")
    if status == L.TIMEOUT:
        return CommTimeoutError(
            f"{where}: {op}: Timed out after {pg.timeout:g} s waiting for rank(s) {ranks} to {waited}; "
            "they are hung, slow, or called another op. The group's CUDA ops are unusable from now on.")
    if status == L.SIZE_MISMATCH:
        return BufferMismatchError(
            f"{where}: in {op}, rank(s) {ranks} sent {int(words[L.FAIL_GOT])} bytes but this rank "
            f"receives {int(words[L.FAIL_EXPECT])}; post receives of the sender's size. "
            "The group's CUDA ops are unusable from now on.")
    return AbortedError(f"{where}: {op} was aborted while waiting for rank(s) {ranks} "
                        "(the group failed or was destroyed)")


def mismatch(pg, names: OpNames, words) -> CollectiveMismatchError:
    """A barrier of op FAIL_OP found ranks FAIL_PEERS in another collective (the lowest of
    them called FAIL_FP): tell the transport (the group's CPU ops fail too, on every rank)
    and name both calls."""
    _, seq, mine = names.entry(int(words[L.FAIL_OP])) or ("", -1, 0)
    bits = int(words[L.FAIL_PEERS])
    others = [pg.members[r] for r in range(bits.bit_length()) if bits >> r & 1]
    culprit, theirs = others[0], int(words[L.FAIL_FP]) & _U64
    me = pg.members[pg.rank()]
    pg.transport.group_mismatch(pg.id, culprit, seq, theirs, me)
    also = f" (ranks {others} all called something other than this rank)" if len(others) > 1 else ""
    return CollectiveMismatchError(
        f"collective mismatch on group {pg.name} (CUDA): rank {culprit} called {describe(theirs)} "
        f"as op #{seq} of the group{also}, but this rank (rank {me}) called {describe(mine & _U64)}. "
        "The group is unusable from now on. Every rank of a group must call the same collectives, "
        "in the same order, with the same dtype, count, root and op.")
