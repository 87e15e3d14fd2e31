"""The collectives of chorus.cuda as functions over an executor ``x`` (chorus.cuda.lanes:
kernels and copies on a CUDA stream; the tests' emulation: numpy and threads).

What an executor offers (addresses are ints; sizes are bytes unless they say elements)::

    x.rank, x.world, x.layout          who I am; the workspace geometry (chorus.cuda.layout)
    x.slot_bytes()                     bytes of one slot of this op (a graph slot when captured)
    x.round()                          start a round: the next parity of the slots
    x.slot(r)                          rank r's collective slot of this round (its address)
    x.barrier()                        every rank arrives; writes before it are seen after it
    x.copy(dst, src, nbytes, peer)     copy engine (peer: the rank whose memory is read/written)
    x.reduce(out, offset, n)           out[:n] = op over ranks r (in order) of slot(r)[offset:][:n]
    x.all_reduce_fused(kind, inp, out, n, per_thread)   one kernel: copy in, barrier(s), reduce (below)
    x.send_chunk(peer, src, nbytes, tag, total)   through my channel to peer (flags, acks)
    x.recv_chunk(peer, dst, nbytes, tag, total)   out of peer's channel to me

Rounds: a round writes only the writer's own slot of its parity, then has one barrier,
then reads.  Round k+2 reuses round k's parity; its writes come after round k+1's barrier,
which every rank reaches only after finishing round k's reads (one stream per rank).

all_reduce runs as one fused kernel per round (chorus.cuda.fused), chosen by size::

    one_shot    (< ONE_SHOT_MAX_BYTES)  rank r: slot_r <- data; barrier; data <- op(slot_0 .. slot_W-1)
    two_shot    (by name; in rounds of the slot)  rank r: slot_r <- data; barrier;
                slot_r[slice r] = data[slice r] <- op over q of slot_q[slice r]; barrier;
                data[slice q] <- slot_q[slice q] for every q
    two_shot_push   (from ONE_SHOT_MAX_BYTES on) as two_shot, but rank r stores its reduced
                slice into every slot_q[slice r] and the all-gather copies from its own slot:
                stores cross the links there, not loads
    two_shot_stores (by name) rank r: row r of slot_q <- data[slice q] for every q; barrier;
                data[slice r] <- op over rows of slot_r, stored into every gather r of slot_q;
                barrier; data[slice q] <- gather q of slot_r: only stores cross the links
                (measured no faster than two_shot_push, in rounds of half the slot)
    copy_reduce (by name only) the copy engine, the barrier kernel, the reduce kernel: three
                launches, as one_shot; kept to compare against

Each of its blocks syncs with the same block of the other ranks only (they touch the same
elements), so a round is one launch with no grid-wide sync.  The other collectives are
one-shot, chunked by the slot: every rank writes its input into its slot, and after the
barrier reads what it needs from every rank's slot::

    reduce      as all_reduce, only the root reads
    broadcast   root: slot_root <- data;         barrier; others: data <- slot_root
    all_gather  rank r: slot_r <- input;         barrier; output[q] <- slot_q for every q
                (fused, the default: one kernel a round, rank r storing its input into
                row r of every slot, then copying the rows of its own: chorus.cuda.gather)
    gather      as all_gather, only the root reads
    scatter     root: slot_root[q] <- input[q];  barrier; rank q: output <- slot_root[q]
    reduce_scatter  rank r: slot_r[q] <- input block q;  barrier; rank q: output <- op over r
                    of slot_r[q]  (slot_r[q]: the q-th of W equal pieces of the slot); with
                    equal blocks fused (one kernel a round: rank r stores block q into row r
                    of slot_q, then reduces the rows of its own slot: chorus.cuda.gather)
    all_to_all  one barrier, then pairwise through the channels (sizes differ per pair)

Every collective passes at least one barrier, where the ranks compare their ops'
fingerprints (chorus.cuda.kernels): ranks that called different collectives learn it
there instead of running mismatched ops over each other's memory.

chorus.cuda.component picks the algorithm by name (``all_reduce_algorithm`` for "auto").
"""

from __future__ import annotations

from chorus.cuda.layout import GRAIN, two_shot_chunk
from chorus.errors import InvalidArgumentError

#: the tag of the channel messages of all_to_all (p2p tags are the user's)
EXCHANGE_TAG = -1


def _chunks(total: int, step: int):
    """(offset, length) pieces of ``total`` units, ``step`` at a time."""
    for off in range(0, total, step):
        yield off, min(step, total - off)


#: all_reduce by size, measured on 4 x H200 (NVLink, bf16, GPU time per call; every
#: algorithm in one run: docs/results/4xh200/calibrate-bf16-w4.json, made by
#:     chorus bench --device cuda --collective all_reduce -b 16K -e 16M -f 2 -n 200 -w 20 \
#:         --baseline none --algorithm one_shot,two_shot,copy_reduce
#: ): one-shot below ONE_SHOT_MAX_BYTES (one barrier: 7.3 us at 16 KiB, 13.0 at 512 KiB,
#: against two-shot's 12.9 and 14.7), two-shot from there (it reads half as much over
#: NVLink: 17.2 us at 1 MiB against 19.5); copy_reduce is slower at every size measured.
#: Of the two-shot kernels, two_shot_push is the fastest from 1 MiB to 1 GiB (15.8 us at
#: 1 MiB and 8.5 ms at 1 GiB, against two_shot's 17.5 us and 10.3 ms in the same run:
#: docs/results/4xh200/pull-vs-push-bf16-w4.json; two_shot_stores 490 us and 8.5 ms:
#: calibrate-two-shot-bf16-w4.json).
#: From chorus.cuda.nccl.nccl_from (CHORUS_CUDA_NCCL_FROM_BYTES, 16 MiB, or what one
#: two-shot round holds: 13.9 MiB of the default workspace) the component hands all_reduce
#: to NCCL's kernels instead: in one run two_shot_push (8 elements a thread) took 35.9 us
#: at 4 MiB against NCCL's 40.0, and 61.3, 151.4 and 715.9 us at 8, 16 and 64 MiB against
#: 59.1, 96.7 and 319.6 (docs/results/4xh200/calibrate-nccl-bf16-w4.json; 16 MiB and more
#: take several rounds); with 16 elements a thread from 4 MiB (MID_PER_THREAD, below) it
#: took 58.1 and 57.6 us at 8 MiB against NCCL's 60.2 and 59.2 in two runs of one round
#: each, so 8 MiB stays on chorus's kernel.
ONE_SHOT_MAX_BYTES = 1 << 20
#: ... for groups of more ranks than this, two-shot from ONE_SHOT_MAX_BYTES / 4 on (every
#: one-shot rank reads W - 1 peers' whole messages; two-shot reads 2 (W - 1) / W of one)
ONE_SHOT_WIDE = 4
ALL_REDUCE_ALGORITHMS = ("one_shot", "two_shot", "two_shot_push", "two_shot_stores", "copy_reduce")


#: two-shot's threads move 8 elements a step, WIDE_PER_THREAD from WIDE_FROM_BYTES on
#: (two_shot_push, 4 x H200, bf16: 8 elements 15.8 us at 1 MiB, 127.6 at 16 MiB, 538 at
#: 64 MiB, 8364 at 1 GiB; 32 elements 20.4, 133.1, 482 and 7259: in
#: docs/results/4xh200/calibrate-two-shot-bf16-w4.json and
#: calibrate-two-shot-32-per-thread-bf16-w4.json, commands in that folder's README)
WIDE_FROM_BYTES = 64 << 20
WIDE_PER_THREAD = 32
#: ... and MID_PER_THREAD from MID_FROM_BYTES up to there (two_shot_push, 4 x H200, bf16,
#: against NCCL in the same run: 16 elements 34.2 and 58.1 us at 4 and 8 MiB against NCCL's
#: 40.7 and 60.2, docs/results/4xh200/speed-run-7/two-shot-shape/shape-16-128-4.txt; with
#: 8 elements, in three rounds on another start, 39.8 and 69.3 against 43.8 and 67.7:
#: speed-run-7/handoff_from.log; commands in speed-run-7/README.md)
MID_FROM_BYTES = 4 << 20
MID_PER_THREAD = 16


def all_reduce_algorithm(nbytes: int, world: int) -> str:
    """The all_reduce algorithm for a message of ``nbytes`` on ``world`` ranks."""
    limit = ONE_SHOT_MAX_BYTES if world <= ONE_SHOT_WIDE else ONE_SHOT_MAX_BYTES // 4
    return "one_shot" if nbytes < limit or world < 2 else "two_shot_push"


def all_reduce(x, data: int, n: int, item: int, algorithm: str = "auto"):
    """All-reduce ``n`` elements of ``item`` bytes at ``data`` in place.  Returns the
    launch's Shot where the whole message was one fused launch that ``x.shot`` can repeat
    (chorus.cuda.lanes), else None."""
    if algorithm not in ALL_REDUCE_ALGORITHMS:
        algorithm = all_reduce_algorithm(n * item, x.world)
    if algorithm == "copy_reduce":
        for off, m in _chunks(n, x.layout.slot // item):
            x.round()
            x.copy(x.slot(x.rank), data + off * item, m * item, x.rank)
            x.barrier()
            x.reduce(data + off * item, 0, m)
        return None
    slot = x.slot_bytes()  # (captured in a CUDA graph: a graph slot's)
    if algorithm == "one_shot":
        step = slot // item
    else:  # (two_shot_stores: rows and gathers, twice the message)
        step = two_shot_chunk(slot // (2 if algorithm == "two_shot_stores" else 1), item, x.world)
    nbytes = n * item
    per_thread = WIDE_PER_THREAD if nbytes >= WIDE_FROM_BYTES else MID_PER_THREAD if nbytes >= MID_FROM_BYTES else 8
    if n <= step:  # one launch
        x.round()
        return x.all_reduce_fused(algorithm, data, data, n, per_thread)
    for off, m in _chunks(n, step):
        x.round()
        x.all_reduce_fused(algorithm, data + off * item, data + off * item, m, per_thread)
    return None


def reduce(x, data: int, n: int, item: int, root: int) -> None:
    for off, m in _chunks(n, x.layout.slot // item):
        x.round()
        x.copy(x.slot(x.rank), data + off * item, m * item, x.rank)
        x.barrier()
        if x.rank == root:
            x.reduce(data + off * item, 0, m)


def broadcast(x, data: int, n: int, item: int, root: int) -> None:
    for off, m in _chunks(n, x.layout.slot // item):
        x.round()
        if x.rank == root:
            x.copy(x.slot(root), data + off * item, m * item, root)
        x.barrier()
        if x.rank != root:
            x.copy(data + off * item, x.slot(root), m * item, root)


#: element sizes (bytes) the fused all_gather moves (any dtype of these sizes)
GATHER_ITEMS = frozenset({1, 2, 4, 8})


def rows_chunk(slot_bytes: int, item: int, world: int) -> int:
    """The most elements of each rank's block one fused all_gather / reduce_scatter round
    moves: W rows of them fill a slot of ``slot_bytes``, each row GRAIN-aligned."""
    return slot_bytes // item // world // GRAIN * GRAIN


def all_gather(x, inp: int, out: int | None, n: int, item: int, root: int = -1, fused: bool = False) -> None:
    """All-gather (``root`` -1) or gather to ``root`` (``out`` only there); ``fused``
    (all-gather only): one kernel a round (chorus.cuda.gather), else copies and a barrier."""
    if fused and root == -1:
        for off, m in _chunks(n, rows_chunk(x.layout.slot, item, x.world)):
            x.round()
            x.rows_fused("all_gather", inp + off * item, out + off * item, m, -(-m // GRAIN) * GRAIN, n, item)
        return
    for off, m in _chunks(n, x.layout.slot // item):
        x.round()
        x.copy(x.slot(x.rank), inp + off * item, m * item, x.rank)
        x.barrier()
        if root in (-1, x.rank):
            for r in range(x.world):
                src = inp + off * item if r == x.rank else x.slot(r)
                x.copy(out + (r * n + off) * item, src, m * item, r)


def scatter(x, inp: int | None, out: int, n: int, item: int, root: int) -> None:
    piece = x.layout.piece()
    for off, m in _chunks(n, piece // item):
        x.round()
        if x.rank == root:
            for q in range(x.world):
                if q != root:
                    x.copy(x.slot(root) + q * piece, inp + (q * n + off) * item, m * item, root)
        x.barrier()
        src = inp + (root * n + off) * item if x.rank == root else x.slot(root) + x.rank * piece
        x.copy(out + off * item, src, m * item, root)


def reduce_scatter(x, inp: int, out: int, counts: tuple[int, ...], item: int, fused: bool = False) -> None:
    """``fused`` (equal counts only): one kernel a round (chorus.cuda.gather), else copies,
    a barrier and the reduce kernel."""
    if fused and len(set(counts)) == 1:
        big_n = counts[0]
        for off, m in _chunks(big_n, rows_chunk(x.layout.slot, item, x.world)):
            x.round()
            x.rows_fused("reduce_scatter", inp + off * item, out + off * item, m, -(-m // GRAIN) * GRAIN, big_n,
                         item)
        return
    piece = x.layout.piece()
    step = piece // item
    starts = [sum(counts[:q]) for q in range(x.world)]
    for off, _ in _chunks(max(counts, default=0), step):
        x.round()
        for q in range(x.world):
            m = max(0, min(step, counts[q] - off))
            x.copy(x.slot(x.rank) + q * piece, inp + (starts[q] + off) * item, m * item, x.rank)
        x.barrier()
        x.reduce(out + off * item, x.rank * piece, max(0, min(step, counts[x.rank] - off)))


def exchange(x, sends, recvs, always: bool) -> None:
    """Move every message of ``sends`` (peer, address, nbytes, tag) and ``recvs`` (same)
    through the channels, chunk by chunk: in round k every message's k-th chunk is sent,
    then every message's k-th chunk is received.  A rank waits only for chunks its peers
    send in the same round or for acks of two rounds back, so a batch never deadlocks,
    whatever the order of its messages.  ``always``: an empty message still sends one
    chunk (its header: point-to-point matching); else empty messages send nothing
    (all_to_all, where both sides know the size)."""
    size = x.layout.channel

    def count(nbytes: int) -> int:
        return max(1 if always else 0, -(-nbytes // size))

    rounds = max((count(m[2]) for m in (*sends, *recvs)), default=0)
    for k in range(rounds):
        for peer, addr, nbytes, tag in sends:
            if k < count(nbytes):
                x.send_chunk(peer, addr + k * size, min(size, nbytes - k * size), tag, nbytes)
        for peer, addr, nbytes, tag in recvs:
            if k < count(nbytes):
                x.recv_chunk(peer, addr + k * size, min(size, nbytes - k * size), tag, nbytes)


def all_to_all(x, inp: int, out: int, send_counts, recv_counts, item: int) -> None:
    x.barrier()  # the channels carry no fingerprint: compare them here
    send_at = [sum(send_counts[:q]) for q in range(x.world)]
    recv_at = [sum(recv_counts[:q]) for q in range(x.world)]
    me = x.rank
    x.copy(out + recv_at[me] * item, inp + send_at[me] * item, send_counts[me] * item, me)
    peers = [q for q in range(x.world) if q != me]
    exchange(x, [(q, inp + send_at[q] * item, send_counts[q] * item, EXCHANGE_TAG) for q in peers],
             [(q, out + recv_at[q] * item, recv_counts[q] * item, EXCHANGE_TAG) for q in peers], False)


def enqueue(x, call, item: int, algorithm: str) -> None:
    """Queue chorus Call ``call``'s op (its buffers CUDA tensors of ``item`` bytes per
    element) on lanes ``x``, begun for it, by ``algorithm``."""
    b = call.buffers
    name = call.name
    if name == "barrier":
        x.barrier()
    elif name == "all_reduce":
        all_reduce(x, b["data"].data_ptr(), b["data"].numel(), item, algorithm)
    elif name == "reduce":
        reduce(x, b["data"].data_ptr(), b["data"].numel(), item, call.root)
    elif name == "broadcast":
        broadcast(x, b["data"].data_ptr(), b["data"].numel(), item, call.root)
    elif name in ("all_gather", "gather"):
        out = b["output"].data_ptr() if "output" in b else None
        all_gather(x, b["input"].data_ptr(), out, b["input"].numel(), item, call.root if name == "gather" else -1,
                   algorithm == "fused")
    elif name == "scatter":
        inp = b["input"].data_ptr() if "input" in b else None
        scatter(x, inp, b["output"].data_ptr(), b["output"].numel(), item, call.root)
    elif name == "reduce_scatter":
        reduce_scatter(x, b["input"].data_ptr(), b["output"].data_ptr(), tuple(call.args["counts"]), item,
                       algorithm == "fused")
    elif name == "all_to_all":
        all_to_all(x, b["input"].data_ptr(), b["output"].data_ptr(), call.args["send_counts"],
                   call.args["recv_counts"], item)
    else:
        raise InvalidArgumentError(f"chorus.cuda cannot run {name}")
