"""The fused all_reduce kernels of chorus.cuda (launched by chorus.cuda.launchers): one
launch per round of the slot does the copy into this rank's slot, the barrier and the
reduction (one-shot), or the copy, a barrier, the reduce-scatter, a barrier and the
all-gather (two-shot).

The barrier is per block: block b of every rank copies, syncs and reads the same element
range, so block b needs only the other ranks' block b (chorus.cuda.layout's per-block
words; block 0 uses the group's BARRIER/FPRINT words, where it meets
chorus.cuda.kernels.barrier_kernel: a rank in another op is a MISMATCH, as ever).  The
memory-model helpers, the control page's words and the reduction ops are
chorus.cuda.kernels'.
"""

from __future__ import annotations

import triton
import triton.language as tl

from chorus.cuda.kernels import (
    as_ptr,
    combine,
    give_up,
    is_broken,
    load_acquire,
    narrow,
    now,
    store_pair_release,
    widen,
)


@triton.jit
def _spin_block(addrs, mask, target, host, mirror, timeout_ns, max_spins, INTERPRET: tl.constexpr):
    """As _spin, and also ends when another block of this rank already broke the group
    (STATUS set): 0 OK, 1 TIMEOUT, 2 ABORTED, 3 broken elsewhere.  (The interpreter's
    form; on a GPU _spin_peers.)"""
    state = 0
    spins = tl.zeros([], tl.int64)
    start = now(INTERPRET)
    while state == 0:
        late = mask & ((load_acquire(addrs, INTERPRET) - target) < 0)
        spins += 1
        if tl.sum(late.to(tl.int32)) == 0:
            state = 1
        elif spins % 32 == 0:
            state = _host_says(host, mirror, start, timeout_ns, spins, max_spins, INTERPRET)
    return state - 1


@triton.jit
def _host_says(host, mirror, start, timeout_ns, spins, max_spins, INTERPRET: tl.constexpr):
    """0: keep spinning; 2 TIMEOUT, 3 ABORTED, 4 broken elsewhere (a spin's state + 1).
    Called every 32 polls; reads the host page's ABORT when this block has the turn
    (_host_turn; under the interpreter, every time)."""
    state = 0
    t = now(INTERPRET)
    if _host_turn(mirror, t, spins, INTERPRET):
        if tl.load(host + 0, volatile=True) != 0:  # ABORT
            state = 3
    if state == 0:
        if is_broken(host, mirror):  # another block gave up
            state = 4
        elif ((t - start) > timeout_ns) | (spins >= max_spins):
            state = 2
    return state


@triton.jit
def _host_turn(mirror, t, spins, INTERPRET: tl.constexpr):
    """Whether this block reads the host page now: from its 512th poll, when HOST_POLL_NS
    have passed since its rank's last read in this group (the HOST_POLL word of the
    rank's workspace, 32 bytes after BROKEN at ``mirror``, which a fused kernel always
    has; a time ahead of ``t`` counts as passed) and the CAS of ``t`` there wins.  About
    one read per interval (each warp compares the CAS's result with its own view of the
    word, so a few warps may read): the GPU serves host reads one after another, so
    every spinning block reading at once would hold each block up behind the others'."""
    if INTERPRET:
        turn = spins >= 0
    else:
        turn = spins < 0
        if spins >= 512:  # (the same in every thread: the spin's polls are block-wide votes)
            word = as_ptr(mirror + 32, tl.int64)  # HOST_POLL
            last = tl.load(word, volatile=True)
            since = t - last
            due = ((since >= 20000) | (since < 0)).to(tl.int32)  # HOST_POLL_NS; ahead of t: due too
            # the block's one answer first: Triton shares the CAS's result through shared
            # memory between two bar.sync, which every thread of the block must reach
            if _block_any(due) != 0:
                turn = tl.atomic_cas(word, last, t, sem="relaxed", scope="gpu") == last
    return turn


# On a GPU a block's barrier is one thread per peer, as in hand-written CUDA (thread t < W
# pushes to peer t and polls the word peer t writes) and one block-wide vote (bar.red) per
# poll.  Every thread of the block runs these (scalar) asm statements; the %tid.x
# predicate picks the W that touch memory.  Block-wide tensors of W words would be held,
# stored and polled by every thread of a warp (Triton replicates small tensors), each
# poll a system-scope acquire, and each block would spend microseconds per barrier.
@triton.jit
def _push_peers(controls_addr, world, fp_off, fprint, bar_off, epoch):
    """Thread t < ``world``: peer t's word at ``fp_off`` = ``fprint`` (plain), then its
    word at ``bar_off`` = ``epoch`` (release, system scope).  ``controls_addr``: the int64
    addresses of every rank's workspace; the offsets are from each one's base."""
    tl.inline_asm_elementwise(
        """{ .reg .u32 %t; .reg .pred %w; .reg .u64 %a, %p;
             mov.u32 %t, %tid.x; setp.lt.u32 %w, %t, $1;
             @%w mul.wide.u32 %a, %t, 8; @%w add.u64 %a, %a, $2; @%w ld.global.u64 %p, [%a];
             @%w add.u64 %a, %p, $3; @%w st.global.b64 [%a], $4;
             @%w add.u64 %a, %p, $5; @%w st.release.sys.global.b64 [%a], $6;
             mov.u32 $0, 0; }""",
        "=r,r,l,l,l,l,l", [world, controls_addr, fp_off, fprint, bar_off, epoch], dtype=tl.int32,
        is_pure=False, pack=1)


@triton.jit
def _peers_arrived(words, world, target):
    """Thread t < ``world`` reads the word at ``words`` + 8 t (acquire, system scope);
    every thread gets 1 when each of them is >= ``target``, else 0 (a block-wide vote)."""
    return tl.inline_asm_elementwise(
        """{ .reg .u32 %t; .reg .pred %w, %ok, %all; .reg .u64 %a; .reg .s64 %v;
             mov.u32 %t, %tid.x; setp.lt.u32 %w, %t, $1; setp.eq.u32 %ok, %t, %t;
             @%w mul.wide.u32 %a, %t, 8; @%w add.u64 %a, %a, $2;
             @%w ld.acquire.sys.global.b64 %v, [%a]; @%w sub.s64 %v, %v, $3; @%w setp.ge.s64 %ok, %v, 0;
             bar.red.and.pred %all, 15, %ok; selp.u32 $0, 1, 0, %all; }""",
        "=r,r,l,l", [world, words, target], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _peers_differ(words, world, value):
    """1 in every thread when some word at ``words`` + 8 t (t < ``world``) != ``value``."""
    return tl.inline_asm_elementwise(
        """{ .reg .u32 %t; .reg .pred %w, %no, %any; .reg .u64 %a; .reg .s64 %v;
             mov.u32 %t, %tid.x; setp.lt.u32 %w, %t, $1; setp.ne.u32 %no, %t, %t;
             @%w mul.wide.u32 %a, %t, 8; @%w add.u64 %a, %a, $2;
             @%w ld.relaxed.sys.global.b64 %v, [%a]; @%w setp.ne.s64 %no, %v, $3;
             bar.red.or.pred %any, 15, %no; selp.u32 $0, 1, 0, %any; }""",
        "=r,r,l,l", [world, words, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _agree(state):
    """The block's one verdict of _host_says (every thread gets it): ABORTED (3) where any
    thread read ABORT, else broken elsewhere (4) where any saw BROKEN, else TIMEOUT (2)
    where any found the time up, else 0.  The warps of a block read the clock and the
    words at different moments; a warp that left the spin alone would leave the others
    waiting at the next poll's block-wide vote for ever."""
    return tl.inline_asm_elementwise(
        """{ .reg .pred %a, %b, %c, %A, %B, %C; .reg .s32 %r;
             setp.eq.s32 %a, $1, 3; setp.eq.s32 %b, $1, 4; setp.eq.s32 %c, $1, 2;
             bar.red.or.pred %A, 15, %a; bar.red.or.pred %B, 15, %b; bar.red.or.pred %C, 15, %c;
             selp.s32 %r, 2, 0, %C; selp.s32 %r, 4, %r, %B; selp.s32 $0, 3, %r, %A; }""",
        "=r,r", [state], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _block_any(flag):
    """1 in every thread of the block when ``flag`` (an int32) is nonzero in any of them."""
    return tl.inline_asm_elementwise(
        """{ .reg .pred %p, %any; setp.ne.s32 %p, $1, 0; bar.red.or.pred %any, 15, %p;
             selp.s32 $0, 1, 0, %any; }""",
        "=r,r", [flag], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _spin_peers(words, world, target, host, mirror, timeout_ns, max_spins, INTERPRET: tl.constexpr):
    """_spin_block's states, polling one word per peer thread (_peers_arrived); the
    block leaves the spin together (_agree)."""
    state = 0
    spins = tl.zeros([], tl.int64)
    start = now(INTERPRET)
    while state == 0:
        spins += 1
        if _peers_arrived(words, world, target) != 0:
            state = 1
        elif spins % 32 == 0:
            state = _agree(_host_says(host, mirror, start, timeout_ns, spins, max_spins, INTERPRET).to(tl.int32))
    return state - 1


@triton.jit
def broken_at_start(host, mirror, INTERPRET: tl.constexpr):
    """is_broken, the same answer in every thread of the block (the block syncs later)."""
    broken = is_broken(host, mirror)
    if not INTERPRET:
        broken = _block_any(broken.to(tl.int32)) != 0
    return broken


@triton.jit
def kernel_start(host_addr, controls_addr, rank, INTERPRET: tl.constexpr):
    """What every fused kernel starts with: the control page and the workspaces' address
    table as pointers, this rank's workspace, its BROKEN word, and whether the group is
    broken (the block's one answer)."""
    host = as_ptr(host_addr, tl.int64)
    controls = as_ptr(controls_addr, tl.int64)
    base = tl.load(controls + rank)
    mirror = base + 8  # BROKEN
    return host, controls, base, mirror, broken_at_start(host, mirror, INTERPRET)


@triton.jit
def _slice_range(s, piece, start, per, n):
    """Elements [lo, hi) of slice s (elements [s * piece, (s + 1) * piece) of n) that the
    block owning [start, start + per) of every slice handles."""
    lo = s * piece + start
    return lo, tl.maximum(tl.minimum(tl.minimum(lo + per, (s + 1) * piece), n), lo)


@triton.jit
def graph_begin(base, slot_off, epoch, op_id, graph_slot, GRAPH: tl.constexpr):
    """(slot offset, first epoch, op id) of this launch.  ``GRAPH`` 0, eager: the host's.
    1, captured in a CUDA graph (its arguments are frozen at capture, and replayed): slot
    and epoch from the counts in this rank's workspace, GRAPH_OPS % 2 choosing the graph
    slot (``slot_off`` is parity 0's, ``graph_slot`` bytes from parity 1's) and
    GRAPH_EPOCH + 1 the epoch.  2, a lane's replay (chorus.cuda.replays: an eager op
    whose slot is frozen with its graph): the eager words and slots, the epoch from this
    rank's EPOCH word (the barriers so far, kept by every eager kernel) + 1, and the op id
    ``op_id`` + that epoch (the host names it by its epoch: chorus.cuda.failures)."""
    if GRAPH == 1:
        ops = tl.load(as_ptr(base + 16, tl.int64), volatile=True)  # GRAPH_OPS
        slot_off = slot_off + (ops & 1) * graph_slot
        epoch = tl.load(as_ptr(base + 24, tl.int64), volatile=True) + 1  # GRAPH_EPOCH
    if GRAPH == 2:
        epoch = tl.load(as_ptr(base, tl.int64), volatile=True) + 1  # EPOCH
        op_id = op_id + epoch
    return slot_off, epoch, op_id


@triton.jit
def graph_end(base, epoch, BARRIERS: tl.constexpr, GRAPH: tl.constexpr):
    """``GRAPH`` 1: the launch's last block to finish advances GRAPH_OPS by one and
    GRAPH_EPOCH by its ``BARRIERS`` (every block read them at its start; the next launch
    on the stream starts after this one ended, and reads the new counts).  2: its last
    block stores its last epoch into EPOCH (which its block 0 leaves alone meanwhile, as
    every block reads it at its start)."""
    if GRAPH == 1:
        tl.debug_barrier()
        done = tl.atomic_add(as_ptr(base + 32, tl.int64), 1, sem="acq_rel", scope="gpu")  # GRAPH_DONE
        if done == tl.num_programs(0) - 1:
            tl.store(as_ptr(base + 32, tl.int64), 0)
            tl.store(as_ptr(base + 16, tl.int64), tl.load(as_ptr(base + 16, tl.int64), volatile=True) + 1)
            tl.store(as_ptr(base + 24, tl.int64), tl.load(as_ptr(base + 24, tl.int64), volatile=True) + BARRIERS)
    if GRAPH == 2:
        tl.debug_barrier()
        done = tl.atomic_add(as_ptr(base + 48, tl.int64), 1, sem="acq_rel", scope="gpu")  # REPLAY_DONE
        if done == tl.num_programs(0) - 1:
            tl.store(as_ptr(base + 48, tl.int64), 0)
            tl.store(as_ptr(base, tl.int64), (epoch + BARRIERS - 1).to(tl.int64))  # EPOCH


@triton.jit
def block_sync(controls, rank, blk, epoch, fprint, host, mirror, op_id, timeout_ns, max_spins,
                W: tl.constexpr, WP: tl.constexpr, INTERPRET: tl.constexpr, GRAPH: tl.constexpr = False):
    """Block ``blk``'s barrier at ``epoch``: push (fingerprint, epoch) into every rank's
    words of this block (release), spin on mine (acquire), compare the fingerprints.
    0: go on; else the block stops (block 0 reports a MISMATCH; a timeout or abort is
    reported by the block that saw it).  Needs at least W threads in the block.
    ``GRAPH`` 1: a captured kernel's words (GRAPH_BLOCKS), apart from the eager ones; 2:
    the eager ones, EPOCH left to graph_end."""
    lanes = tl.arange(0, WP)
    mask = lanes < W
    if GRAPH == 1:
        bar = 199168 + blk.to(tl.int64) * 1536  # GRAPH_BLOCKS + b * BLOCK_STRIDE
        prints = bar + 512 + (epoch & 1) * 512
    else:
        extra = 4096 + (blk - 1).to(tl.int64) * 1536  # BLOCKS + (b - 1) * BLOCK_STRIDE
        bar = tl.where(blk == 0, 512, extra)
        prints = tl.where(blk == 0, 2560, extra + 512) + (epoch & 1) * 512
    base = tl.load(controls + rank)
    if (blk == 0) & (GRAPH == 0):
        tl.store(as_ptr(base, tl.int64), epoch.to(tl.int64))  # EPOCH: barriers so far
    mine = base + bar + lanes * 8
    e = tl.zeros([WP], tl.int64) + epoch
    mine_fp = tl.zeros([WP], tl.int64) + fprint
    if INTERPRET:
        peers = tl.load(controls + lanes, mask=mask, other=0)
        store_pair_release(peers + prints + rank * 8, mine_fp, peers + bar + rank * 8, e, mask, INTERPRET)
        state = _spin_block(mine, mask, epoch, host, mirror, timeout_ns, max_spins, INTERPRET)
    else:
        world = tl.full([], W, tl.int32)
        _push_peers(controls.to(tl.int64), world, prints + rank * 8, fprint.to(tl.int64), bar + rank * 8,
                    epoch.to(tl.int64))
        state = _spin_peers(base + bar, world, epoch.to(tl.int64), host, mirror, timeout_ns, max_spins, INTERPRET)
    one = tl.full([WP], 1, tl.int64) << lanes.to(tl.int64)
    if (state == 1) | (state == 2):
        late = mask & ((load_acquire(mine, INTERPRET) - epoch) < 0)
        give_up(host, mirror, state, op_id, 0, tl.sum(tl.where(late, one, 0)))
    elif state == 0:
        if INTERPRET:
            differ = 1
        else:
            differ = _peers_differ(base + prints, tl.full([], W, tl.int32), fprint.to(tl.int64))
        if differ != 0:  # (the interpreter always looks; a GPU, after the vote says so)
            theirs = load_acquire(base + prints + lanes * 8, INTERPRET)
            other = mask & (theirs != mine_fp)
            if tl.sum(other.to(tl.int32)) != 0:
                state = 4
                if blk == 0:
                    first = tl.min(tl.where(other, lanes, WP))
                    tl.store(host + 7, tl.sum(tl.where(lanes == first, theirs, 0)))  # FAIL_FP
                    give_up(host, mirror, 4, op_id, 0, tl.sum(tl.where(other, one, 0)))  # MISMATCH
    return state


# The 16-byte alignment hint (tl.multiple_of) must be given to a pointer computed in the
# function that applies it: on a function's argument it is silently dropped, and every
# load falls back to one element.  So get_vec and put_vec take the base and the offsets.
@triton.jit
def get_vec(base, offs, mask, MASKED: tl.constexpr, PEER: tl.constexpr, HINT: tl.constexpr):
    """Load ``base[offs]``; a peer's memory bypasses L1 (written by another GPU since we
    last looked).  ``HINT``: ``base + offs`` is a contiguous run that starts 16-byte aligned."""
    ptrs = base + offs
    if HINT:
        ptrs = tl.multiple_of(ptrs, 16)
    if MASKED:
        if PEER:
            x = tl.load(ptrs, mask=mask, other=0, cache_modifier=".cg")
        else:
            x = tl.load(ptrs, mask=mask, other=0)
    else:
        if PEER:
            x = tl.load(ptrs, cache_modifier=".cg")
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def put_vec(base, offs, values, mask, MASKED: tl.constexpr, HINT: tl.constexpr):
    """``base[offs] = values`` (``HINT`` as get_vec's)."""
    ptrs = base + offs
    if HINT:
        ptrs = tl.multiple_of(ptrs, 16)
    if MASKED:
        tl.store(ptrs, values, mask=mask)
    else:
        tl.store(ptrs, values)


@triton.jit
def _copy(src_addr, dst_addr, lo, hi, RAW: tl.constexpr, BLOCK: tl.constexpr, HS: tl.constexpr,
          HD: tl.constexpr, PEER: tl.constexpr):
    """dst[lo:hi] = src[lo:hi] (elements of RAW; addresses as int64)."""
    copy_shifted(src_addr, dst_addr, lo, hi, 0, 0, RAW, BLOCK, HS, HD, PEER)


@triton.jit
def copy_shifted(src_addr, dst_addr, lo, hi, src_shift, dst_shift, RAW: tl.constexpr, BLOCK: tl.constexpr,
                  HS: tl.constexpr, HD: tl.constexpr, PEER: tl.constexpr):
    """dst[i + dst_shift] = src[i + src_shift] for i in [lo, hi) (shifts: multiples of
    layout.GRAIN, so the alignment hints hold)."""
    src = as_ptr(src_addr, RAW)
    dst = as_ptr(dst_addr, RAW)
    full = (hi - lo) // BLOCK
    for i in range(0, full):
        offs = lo + i * BLOCK + tl.arange(0, BLOCK)
        put_vec(dst, offs + dst_shift, get_vec(src, offs + src_shift, offs < hi, False, PEER, HS), offs < hi, False, HD)
    tail = lo + full * BLOCK
    if tail < hi:
        offs = tail + tl.arange(0, BLOCK)
        m = offs < hi
        put_vec(dst, offs + dst_shift, get_vec(src, offs + src_shift, m, True, PEER, HS), m, True, HD)


@triton.jit
def _row_at(controls, r, slot_off, offs, mask, MASKED: tl.constexpr, DT: tl.constexpr, RAW: tl.constexpr,
            ACC: tl.constexpr, BOOL: tl.constexpr, HINT: tl.constexpr):
    row = as_ptr(tl.load(controls + r) + slot_off, RAW)
    return widen(get_vec(row, offs, mask, MASKED, True, HINT), DT, RAW, ACC, BOOL)


@triton.jit
def _reduce_step(controls, slot_off, offs, mask, MASKED: tl.constexpr, W: tl.constexpr, OP: tl.constexpr,
                 DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr, HINT: tl.constexpr):
    acc = _row_at(controls, 0, slot_off, offs, mask, MASKED, DT, RAW, ACC, BOOL, HINT)
    for r in tl.static_range(1, W):
        acc = combine(acc, _row_at(controls, r, slot_off, offs, mask, MASKED, DT, RAW, ACC, BOOL, HINT), OP)
    return narrow(acc, DT, RAW)


@triton.jit
def _spread(controls, slot_off, also, offs, y, m, MASKED: tl.constexpr, W: tl.constexpr, RAW: tl.constexpr,
            HINT_WS: tl.constexpr, ALSO: tl.constexpr, PUSH: tl.constexpr):
    """Where a reduced piece goes besides the output: this rank's slot (ALSO) or every
    rank's (PUSH: stores over the links, which cost no round trip as loads do)."""
    if PUSH:
        for r in tl.static_range(W):
            row = as_ptr(tl.load(controls + r) + slot_off, RAW)
            put_vec(row, offs, y, m, MASKED, HINT_WS)
    elif ALSO:
        put_vec(also, offs, y, m, MASKED, HINT_WS)


@triton.jit
def _reduce_range(controls, slot_off, out_addr, also_addr, lo, hi, W: tl.constexpr, OP: tl.constexpr,
                  DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr,
                  BLOCK: tl.constexpr, HINT_IO: tl.constexpr, HINT_WS: tl.constexpr, ALSO: tl.constexpr,
                  PUSH: tl.constexpr = False):
    """out[lo:hi] = op over ranks r of slot_r[lo:hi] (rank order, in ACC); when ALSO, the
    result goes to ``also_addr`` (this rank's slot) too; when PUSH, to every rank's slot."""
    out = as_ptr(out_addr, RAW)
    also = as_ptr(also_addr, RAW)
    full = (hi - lo) // BLOCK
    for i in range(0, full):
        offs = lo + i * BLOCK + tl.arange(0, BLOCK)
        m = offs < hi
        y = _reduce_step(controls, slot_off, offs, m, False, W, OP, DT, RAW, ACC, BOOL, HINT_WS)
        put_vec(out, offs, y, m, False, HINT_IO)
        _spread(controls, slot_off, also, offs, y, m, False, W, RAW, HINT_WS, ALSO, PUSH)
    tail = lo + full * BLOCK
    if tail < hi:
        offs = tail + tl.arange(0, BLOCK)
        m = offs < hi
        y = _reduce_step(controls, slot_off, offs, m, True, W, OP, DT, RAW, ACC, BOOL, HINT_WS)
        put_vec(out, offs, y, m, True, HINT_IO)
        _spread(controls, slot_off, also, offs, y, m, True, W, RAW, HINT_WS, ALSO, PUSH)


@triton.jit(do_not_specialize=["inp", "out", "slot_off", "n", "per", "op_id", "fprint", "epoch", "graph_slot"])
def one_shot_kernel(inp, out, controls_addr, slot_off, n, per, rank, host_addr, op_id, fprint, epoch, graph_slot,
                    timeout_ns, max_spins, W: tl.constexpr, WP: tl.constexpr, OP: tl.constexpr, DT: tl.constexpr,
                    RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr, BLOCK: tl.constexpr,
                    HINT_IO: tl.constexpr, HINT_WS: tl.constexpr, INTERPRET: tl.constexpr, GRAPH: tl.constexpr):
    """One-shot all_reduce of elements [0, n) in one launch.  Block b (elements
    [b * per, (b + 1) * per)): copy them from ``inp`` into this rank's slot (at
    ``slot_off`` in its workspace), barrier of block b at ``epoch``, then
    ``out`` = op over every rank's slot, in rank order (the same bits on every rank).
    ``GRAPH``: captured in a CUDA graph, or a lane's replay (graph_begin: slot, epoch and
    op id from the device)."""
    host, controls, base, mirror, broken = kernel_start(host_addr, controls_addr, rank, INTERPRET)
    slot_off, epoch, op_id = graph_begin(base, slot_off, epoch, op_id, graph_slot, GRAPH)
    blk = tl.program_id(0)
    lo = blk.to(tl.int64) * per
    hi = tl.maximum(tl.minimum(lo + per, n), lo)
    mine = base + slot_off
    _copy(inp, mine, lo, hi, RAW, BLOCK, HINT_IO, HINT_WS, False)
    tl.debug_barrier()  # every thread's copy is done before the release
    if not broken:  # (a broken group's kernel copies into its own slot only)
        state = block_sync(controls, rank, blk, epoch, fprint, host, mirror, op_id, timeout_ns, max_spins, W, WP,
                            INTERPRET, GRAPH)
        tl.debug_barrier()
        if state == 0:
            _reduce_range(controls, slot_off, out, mine, lo, hi, W, OP, DT, RAW, ACC, BOOL, BLOCK, HINT_IO,
                          HINT_WS, False)
    graph_end(base, epoch, 1, GRAPH)


@triton.jit(do_not_specialize=["inp", "out", "slot_off", "n", "per", "op_id", "fprint", "epoch", "graph_slot"])
def two_shot_kernel(inp, out, controls_addr, slot_off, n, per, piece, rank, host_addr, op_id, fprint, epoch,
                    graph_slot, timeout_ns, max_spins, W: tl.constexpr, WP: tl.constexpr, OP: tl.constexpr,
                    DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr, BLOCK: tl.constexpr,
                    HINT_IO: tl.constexpr, HINT_WS: tl.constexpr, INTERPRET: tl.constexpr, GRAPH: tl.constexpr,
                    PUSH: tl.constexpr = False):
    """Two-shot all_reduce of elements [0, n) in one launch, two barriers (epochs
    ``epoch`` and ``epoch + 1``).  Slice s = elements [s * piece, (s + 1) * piece); block
    b owns elements [b * per, (b + 1) * per) of every slice::

        copy:           my slot[every slice, my range] <- inp
        barrier 1
        reduce-scatter: my slot[slice rank] = out[slice rank] = op over r of slot_r[slice rank]
        barrier 2
        all-gather:     out[slice s] <- slot_s[slice s] for every s != rank

    PUSH: the reduce-scatter stores its slice into every rank's slot (slot_r[slice rank]:
    after barrier 1 only this rank reads it), and the all-gather reads only this rank's
    own slot; the same bytes cross the links, as stores instead of loads.
    Every slice is reduced once (by its owner) and copied: the same bits everywhere.
    ``GRAPH``: as one_shot_kernel's."""
    host, controls, base, mirror, broken = kernel_start(host_addr, controls_addr, rank, INTERPRET)
    slot_off, epoch, op_id = graph_begin(base, slot_off, epoch, op_id, graph_slot, GRAPH)
    blk = tl.program_id(0)
    start = blk.to(tl.int64) * per
    mine = base + slot_off
    for s in tl.static_range(W):
        lo, hi = _slice_range(s, piece, start, per, n)
        _copy(inp, mine, lo, hi, RAW, BLOCK, HINT_IO, HINT_WS, False)
    tl.debug_barrier()
    if not broken:
        state = block_sync(controls, rank, blk, epoch, fprint, host, mirror, op_id, timeout_ns, max_spins, W, WP,
                            INTERPRET, GRAPH)
        tl.debug_barrier()
        if state == 0:
            lo, hi = _slice_range(rank, piece, start, per, n)
            _reduce_range(controls, slot_off, out, mine, lo, hi, W, OP, DT, RAW, ACC, BOOL, BLOCK, HINT_IO,
                          HINT_WS, True, PUSH)
            tl.debug_barrier()
            state = block_sync(controls, rank, blk, epoch + 1, fprint, host, mirror, op_id, timeout_ns, max_spins, W,
                                WP, INTERPRET, GRAPH)
            tl.debug_barrier()
            if state == 0:
                for s in tl.static_range(W):
                    if s != rank:
                        lo, hi = _slice_range(s, piece, start, per, n)
                        src = mine if PUSH else tl.load(controls + s) + slot_off
                        _copy(src, out, lo, hi, RAW, BLOCK, HINT_WS, HINT_IO, True)
    graph_end(base, epoch, 2, GRAPH)


@triton.jit
def reduce_local_rows(mine_addr, offs, row_stride, m, MASKED: tl.constexpr, W: tl.constexpr, OP: tl.constexpr,
                      DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr,
                      HINT_WS: tl.constexpr):
    """op over q of this rank's slot at ``q * row_stride + offs`` (rows the peers stored
    there: read past L1), in rank order, as stored elements."""
    mine = as_ptr(mine_addr, RAW)
    acc = widen(get_vec(mine, offs, m, MASKED, True, HINT_WS), DT, RAW, ACC, BOOL)
    for q in tl.static_range(1, W):
        acc = combine(acc, widen(get_vec(mine, q * row_stride + offs, m, MASKED, True, HINT_WS), DT, RAW, ACC, BOOL),
                      OP)
    return narrow(acc, DT, RAW)


@triton.jit
def _reduce_rows(controls, slot_off, mine_addr, out_addr, lo, hi, piece, rank, MASKED: tl.constexpr,
                 W: tl.constexpr, OP: tl.constexpr, DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr,
                 BOOL: tl.constexpr, BLOCK: tl.constexpr, HINT_IO: tl.constexpr, HINT_WS: tl.constexpr):
    """One step of two_shot_stores_kernel's reduction, elements [lo, lo + BLOCK) of slice
    ``rank`` (those < ``hi``): out = op over r of my row r (local reads), and the result
    stored into every other rank's gather row ``rank``."""
    offs = lo + tl.arange(0, BLOCK)
    m = offs < hi
    loc = offs - rank * piece  # within the slice
    y = reduce_local_rows(mine_addr, loc, piece, m, MASKED, W, OP, DT, RAW, ACC, BOOL, HINT_WS)
    put_vec(as_ptr(out_addr, RAW), offs, y, m, MASKED, HINT_IO)
    for q in tl.static_range(W):
        if q != rank:
            put_vec(as_ptr(tl.load(controls + q) + slot_off, RAW), (W + rank) * piece + loc, y, m, MASKED, HINT_WS)


@triton.jit(do_not_specialize=["inp", "out", "slot_off", "n", "per", "op_id", "fprint", "epoch", "graph_slot"])
def two_shot_stores_kernel(inp, out, controls_addr, slot_off, n, per, piece, rank, host_addr, op_id, fprint, epoch,
                           graph_slot, timeout_ns, max_spins, W: tl.constexpr, WP: tl.constexpr, OP: tl.constexpr,
                           DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr,
                           BLOCK: tl.constexpr, HINT_IO: tl.constexpr, HINT_WS: tl.constexpr,
                           INTERPRET: tl.constexpr, GRAPH: tl.constexpr):
    """Two-shot all_reduce of elements [0, n) in which only stores cross the links (a
    load from a peer waits a round trip; a store does not).  Slot layout, in elements
    (slice s = elements [s * piece, (s + 1) * piece) of the message)::

        row r      [r * piece, (r + 1) * piece)         slice `me` of rank r's input (r writes)
        gather s   [(W + s) * piece, (W + s + 1) * piece)   slice s, reduced (rank s writes)

    Block b owns elements [b * per, (b + 1) * per) of every slice, on every rank::

        scatter:  rank q's row `rank` <- inp[slice q]        for every q (stores)
        barrier 1
        reduce:   out[slice rank] = op over r of my row r (local reads, rank order);
                  rank q's gather `rank` <- it               for every q != rank (stores)
        barrier 2
        gather:   out[slice s] <- my gather s               for every s != rank (local)

    Twice the slot of two_shot per element (rows and gathers); the same bits everywhere:
    every slice is reduced once, by its owner."""
    host, controls, base, mirror, broken = kernel_start(host_addr, controls_addr, rank, INTERPRET)
    slot_off, epoch, op_id = graph_begin(base, slot_off, epoch, op_id, graph_slot, GRAPH)
    blk = tl.program_id(0)
    start = blk.to(tl.int64) * per
    mine = base + slot_off
    if not broken:  # (a broken group's kernel writes nothing into the peers' memory)
        for q in tl.static_range(W):
            lo, hi = _slice_range(q, piece, start, per, n)
            copy_shifted(inp, tl.load(controls + q) + slot_off, lo, hi, 0, (rank - q) * piece, RAW, BLOCK,
                          HINT_IO, HINT_WS, False)
        tl.debug_barrier()  # every thread's stores are done before the release
        state = block_sync(controls, rank, blk, epoch, fprint, host, mirror, op_id, timeout_ns, max_spins, W, WP,
                            INTERPRET, GRAPH)
        tl.debug_barrier()
        if state == 0:
            lo, hi = _slice_range(rank, piece, start, per, n)
            full = (hi - lo) // BLOCK
            for i in range(0, full):
                _reduce_rows(controls, slot_off, mine, out, lo + i * BLOCK, hi, piece, rank, False, W, OP, DT, RAW,
                             ACC, BOOL, BLOCK, HINT_IO, HINT_WS)
            if lo + full * BLOCK < hi:
                _reduce_rows(controls, slot_off, mine, out, lo + full * BLOCK, hi, piece, rank, True, W, OP, DT, RAW,
                             ACC, BOOL, BLOCK, HINT_IO, HINT_WS)
            tl.debug_barrier()
            state = block_sync(controls, rank, blk, epoch + 1, fprint, host, mirror, op_id, timeout_ns, max_spins, W,
                                WP, INTERPRET, GRAPH)
            tl.debug_barrier()
            if state == 0:
                for s in tl.static_range(W):
                    if s != rank:
                        lo, hi = _slice_range(s, piece, start, per, n)
                        copy_shifted(mine, out, lo, hi, W * piece, 0, RAW, BLOCK, HINT_WS, HINT_IO, True)
    graph_end(base, epoch, 2, GRAPH)
