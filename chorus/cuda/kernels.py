"""The Triton kernels of chorus.cuda (launched from the host by chorus.cuda.launchers): a barrier, a flag post and a flag wait (the channel
protocol), and the reduction of W workspace rows.

Synchronisation is by epochs in device memory, pushed: a rank stores (release, system
scope) an increasing value into a word of the *peer's* workspace and spins (acquire,
system scope) on words of its *own*.  Only plain stores and loads cross the link, no
atomics (PCIe peers may lack them).

The barrier also compares what every rank is doing: each rank stores its op's fingerprint
(chorus.wire.fingerprint) into the peer's FPRINT word of the barrier's parity just
before its epoch (one thread, the epoch's release orders both), and once every epoch
has arrived compares the W fingerprints with its own.  Ranks that called another
collective are reported as MISMATCH (their bitmask, and the lowest one's fingerprint)
instead of letting the ranks run ops of different shapes over each other's slots.  The
parity keeps the words stable while they are read: a peer can reach the next barrier of
the same parity only after this rank has reached the one in between.

Every spin is bounded: it gives up when the group's timeout has passed on the GPU's
``%globaltimer``, or when the host sets the ABORT word of the control page (page-locked
host memory, read through unified addressing), or after ``max_spins`` polls.  Giving up
writes why into the control page (chorus.cuda.layout) and ends the kernel; nothing traps
and nothing hangs.  A kernel that starts while the page already holds a STATUS does not
spin at all, so one failure fails the queued ops fast.

Under ``TRITON_INTERPRET=1`` (tests on a CPU) the same kernels run with ``INTERPRET``
set: atomics stand in for the PTX acquire/release instructions and the poll count for
the clock.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
NEVER = 1 << 62  # max_spins when the clock bounds the spin


# -- memory-model helpers ---------------------------------------------------------------------
@triton.jit
def _now(INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.zeros([], tl.int64)
    else:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)


@triton.jit
def _load_acquire(addrs, INTERPRET: tl.constexpr):
    """int64 words at ``addrs`` (a block of addresses), acquire, system scope."""
    ptrs = addrs.to(tl.pointer_type(tl.int64))
    if INTERPRET:
        return tl.atomic_add(ptrs, tl.zeros(addrs.shape, tl.int64), sem="acquire", scope="sys")
    else:
        return tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [addrs],
                                         dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _store_release(addrs, values, mask, INTERPRET: tl.constexpr):
    """``*addrs = values`` where ``mask``, release, system scope (plain stores)."""
    if INTERPRET:
        tl.atomic_xchg(addrs.to(tl.pointer_type(tl.int64)), values, mask=mask, sem="release", scope="sys")
    else:
        tl.inline_asm_elementwise(
            """{ .reg .pred %p; setp.ne.s32 %p, $2, 0; @%p st.release.sys.global.b64 [$1], $3; mov.u32 $0, 0; }""",
            "=r,l,r,l", [addrs, mask.to(tl.int32), values], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_header_release(hdr, tag, nbytes, flag, value, INTERPRET: tl.constexpr):
    """Write a channel header (tag, nbytes) at ``hdr``, then ``*flag = value`` (release):
    one thread does both, so whoever acquires the flag sees the header."""
    if INTERPRET:
        tl.store(hdr.to(tl.pointer_type(tl.int64)), tag)
        tl.store(hdr.to(tl.pointer_type(tl.int64)) + 1, nbytes)
        tl.atomic_xchg(flag.to(tl.pointer_type(tl.int64)), value, sem="release", scope="sys")
    else:
        tl.inline_asm_elementwise(
            """{ st.global.b64 [$1], $2; st.global.b64 [$1+8], $3;
                 st.release.sys.global.b64 [$4], $5; mov.u32 $0, 0; }""",
            "=r,l,l,l,l,l", [hdr, tag, nbytes, flag, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_pair_release(a_addrs, a_values, b_addrs, b_values, mask, INTERPRET: tl.constexpr):
    """``*a_addrs = a_values`` (plain), then ``*b_addrs = b_values`` (release, system
    scope), where ``mask``: both by one thread per lane, so whoever acquires b sees a."""
    if INTERPRET:
        tl.store(a_addrs.to(tl.pointer_type(tl.int64)), a_values, mask=mask)
        tl.atomic_xchg(b_addrs.to(tl.pointer_type(tl.int64)), b_values, mask=mask, sem="release", scope="sys")
    else:
        tl.inline_asm_elementwise(
            """{ .reg .pred %p; setp.ne.s32 %p, $2, 0;
                 @%p st.global.b64 [$1], $3; @%p st.release.sys.global.b64 [$4], $5; mov.u32 $0, 0; }""",
            "=r,l,r,l,l,l", [a_addrs, mask.to(tl.int32), a_values, b_addrs, b_values], dtype=tl.int32,
            is_pure=False, pack=1)


@triton.jit
def _spin(addrs, mask, target, host, timeout_ns, max_spins, INTERPRET: tl.constexpr):
    """Poll the words at ``addrs`` (where ``mask``) until each is >= ``target``: returns
    L.OK, L.TIMEOUT or L.ABORTED."""
    state = 0
    spins = tl.zeros([], tl.int64)
    start = _now(INTERPRET)
    while state == 0:
        late = mask & ((_load_acquire(addrs, INTERPRET) - target) < 0)
        spins += 1
        if tl.sum(late.to(tl.int32)) == 0:
            state = 1
        elif spins % 32 == 0:
            if tl.load(host + 0, volatile=True) != 0:  # ABORT
                state = 3
            elif ((_now(INTERPRET) - start) > timeout_ns) | (spins >= max_spins):
                state = 2
    return state - 1  # 0 OK, 1 TIMEOUT, 2 ABORTED (layout's codes)


@triton.jit
def _give_up(host, state, op_id, what, peers):
    """Record why a spin gave up in the control page; STATUS last."""
    tl.store(host + 2, op_id)  # FAIL_OP
    tl.store(host + 3, what)  # FAIL_WHAT
    tl.store(host + 4, peers)  # FAIL_PEERS
    tl.store(host + 1, state)  # STATUS


# -- kernels ------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["op_id", "fprint", "epoch"])
def barrier_kernel(controls, rank, host_addr, op_id, fprint, timeout_ns, max_spins, epoch,
                   W: tl.constexpr, WP: tl.constexpr, INTERPRET: tl.constexpr):
    """All W ranks: epoch e = mine + 1; store ``fprint`` into FPRINT[e % 2][rank] and then
    e into BARRIER[rank] of every rank; wait until my BARRIER[r] >= e for every r; then
    compare my FPRINT[e % 2][r] with ``fprint``.  ``controls``: int64 addresses of every
    rank's workspace (index = group rank).  ``epoch`` > 0: e itself (the executor counts
    the group's barriers, fused kernels' included); 0: e = my EPOCH word + 1."""
    host = host_addr.to(tl.pointer_type(tl.int64))
    if tl.load(host + 1, volatile=True) == 0:  # STATUS: not broken
        lanes = tl.arange(0, WP)
        mask = lanes < W
        base = tl.load(controls + rank)
        epoch_ptr = base.to(tl.pointer_type(tl.int64))  # EPOCH = 0
        e = tl.load(epoch_ptr) + 1
        if epoch > 0:
            e = epoch.to(tl.int64)
        tl.store(epoch_ptr, e)
        prints = 2560 + (e & 1) * 512  # FPRINT of this parity
        mine_fp = tl.zeros([WP], tl.int64) + fprint
        peers = tl.load(controls + lanes, mask=mask, other=0)
        _store_pair_release(peers + prints + rank * 8, mine_fp, peers + 512 + rank * 8,
                            tl.zeros([WP], tl.int64) + e, mask, INTERPRET)
        mine = base + 512 + lanes * 8  # BARRIER
        state = _spin(mine, mask, e, host, timeout_ns, max_spins, INTERPRET)
        one = tl.full([WP], 1, tl.int64) << lanes.to(tl.int64)
        if state != 0:
            late = mask & ((_load_acquire(mine, INTERPRET) - e) < 0)
            _give_up(host, state, op_id, 0, tl.sum(tl.where(late, one, 0)))
        else:
            theirs = _load_acquire(base + prints + lanes * 8, INTERPRET)
            other = mask & (theirs != mine_fp)
            if tl.sum(other.to(tl.int32)) != 0:
                first = tl.min(tl.where(other, lanes, WP))
                tl.store(host + 7, tl.sum(tl.where(lanes == first, theirs, 0)))  # FAIL_FP
                _give_up(host, 4, op_id, 0, tl.sum(tl.where(other, one, 0)))  # MISMATCH


@triton.jit(do_not_specialize=["value", "tag", "nbytes"])
def post_kernel(flag_addr, value, hdr_addr, tag, nbytes, host_addr,
                HEADER: tl.constexpr, INTERPRET: tl.constexpr):
    """``*flag_addr = value`` (release), after writing the channel header at ``hdr_addr``
    when ``HEADER``.  Skipped once the group is broken."""
    host = host_addr.to(tl.pointer_type(tl.int64))
    if tl.load(host + 1, volatile=True) == 0:
        one = tl.zeros([1], tl.int64)
        if HEADER:
            _store_header_release(one + hdr_addr, one + tag, one + nbytes, one + flag_addr, one + value,
                                  INTERPRET)
        else:
            _store_release(one + flag_addr, one + value, one == 0, INTERPRET)


@triton.jit(do_not_specialize=["target", "expect_tag", "expect_nbytes", "peer", "op_id"])
def wait_kernel(flag_addr, target, hdr_addr, expect_tag, expect_nbytes, peer, host_addr, op_id, what,
                timeout_ns, max_spins, HEADER: tl.constexpr, INTERPRET: tl.constexpr):
    """Wait until ``*flag_addr >= target`` (a local word that peer ``peer`` stores into);
    then, when ``HEADER``, check the sender's channel header at ``hdr_addr``: another
    size breaks the group (SIZE_MISMATCH), another tag is recorded (TAG_*)."""
    host = host_addr.to(tl.pointer_type(tl.int64))
    if tl.load(host + 1, volatile=True) == 0:
        one = tl.zeros([1], tl.int64)
        state = _spin(one + flag_addr, one == 0, target, host, timeout_ns, max_spins, INTERPRET)
        if state != 0:
            _give_up(host, state, op_id, what, tl.full([], 1, tl.int64) << peer)
        elif HEADER:
            hdr = hdr_addr.to(tl.pointer_type(tl.int64))
            got_tag = tl.load(hdr, volatile=True)
            got_nbytes = tl.load(hdr + 1, volatile=True)
            if got_nbytes != expect_nbytes:
                tl.store(host + 5, expect_nbytes)  # FAIL_EXPECT
                tl.store(host + 6, got_nbytes)  # FAIL_GOT
                _give_up(host, 3, op_id, what, tl.full([], 1, tl.int64) << peer)
            elif got_tag != expect_tag:
                tl.store(host + 9, peer)  # TAG_PEER
                tl.store(host + 10, expect_tag)  # TAG_EXPECT
                tl.store(host + 11, got_tag)  # TAG_GOT
                tl.store(host + 8, op_id + 1)  # TAG_OP, last


@triton.jit
def _combine(a, b, OP: tl.constexpr):
    if OP == "SUM":
        return a + b
    elif OP == "PRODUCT":
        return a * b
    elif OP == "MIN":
        return tl.minimum(a, b)
    elif OP == "MAX":
        return tl.maximum(a, b)
    elif OP == "BAND":
        return a & b
    elif OP == "BOR":
        return a | b
    else:  # BXOR
        return a ^ b


@triton.jit
def reduce_kernel(rows, offset, out_addr, n, W: tl.constexpr, OP: tl.constexpr, DT: tl.constexpr,
                  RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i] = op(row_0[i], row_1[i], ..., row_{W-1}[i])`` for i < n, where row r starts
    at ``rows[r] + offset`` (int64 addresses: every rank's slot).  Rows combine in rank
    order, in ``ACC`` (float32 for 8- and 16-bit floats): the same bits on every rank.
    ``BOOL``: bytes read as truth values; SUM/MAX/BOR are or, PRODUCT/MIN/BAND and, BXOR
    xor (chorus.reductions' bool rules).  ``RAW``: how the elements are stored (float8
    moves as bytes and is bitcast)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = _load_row(rows, 0, offset, offs, mask, DT, RAW, ACC, BOOL)
    for r in tl.static_range(1, W):
        acc = _combine(acc, _load_row(rows, r, offset, offs, mask, DT, RAW, ACC, BOOL), OP)
    out = acc.to(DT)
    if RAW != DT:
        out = out.to(RAW, bitcast=True)
    tl.store(out_addr.to(tl.pointer_type(RAW)) + offs, out, mask=mask)


@triton.jit
def _load_row(rows, r, offset, offs, mask, DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr,
              BOOL: tl.constexpr):
    row = (tl.load(rows + r) + offset).to(tl.pointer_type(RAW))
    x = tl.load(row + offs, mask=mask, other=0)
    if RAW != DT:
        x = x.to(DT, bitcast=True)
    x = x.to(ACC)
    if BOOL:
        x = (x != 0).to(ACC)
    return x


# -- fused all_reduce kernels -------------------------------------------------------------------
# One launch per op (per round of the slot): the copy into this rank's slot, the barrier and
# the reduction in one kernel.  The barrier is per block: block b of every rank copies,
# syncs and reads the same element range, so block b needs only the other ranks' block b
# (chorus.cuda.layout's per-block words; block 0 uses the group's BARRIER/FPRINT words,
# where it meets barrier_kernel: a rank in another op is a MISMATCH, as ever).
@triton.jit
def _spin_block(addrs, mask, target, host, timeout_ns, max_spins, INTERPRET: tl.constexpr):
    """As _spin, and also ends when another block of this rank already broke the group
    (STATUS set): 0 OK, 1 TIMEOUT, 2 ABORTED, 3 broken elsewhere."""
    state = 0
    spins = tl.zeros([], tl.int64)
    start = _now(INTERPRET)
    while state == 0:
        late = mask & ((_load_acquire(addrs, INTERPRET) - target) < 0)
        spins += 1
        if tl.sum(late.to(tl.int32)) == 0:
            state = 1
        elif spins % 32 == 0:
            if tl.load(host + 0, volatile=True) != 0:  # ABORT
                state = 3
            elif tl.load(host + 1, volatile=True) != 0:  # STATUS: another block gave up
                state = 4
            elif ((_now(INTERPRET) - start) > timeout_ns) | (spins >= max_spins):
                state = 2
    return state - 1


@triton.jit
def _block_sync(controls, rank, blk, epoch, fprint, host, op_id, timeout_ns, max_spins,
                W: tl.constexpr, WP: tl.constexpr, INTERPRET: tl.constexpr):
    """Block ``blk``'s barrier at ``epoch``: push (fingerprint, epoch) into every rank's
    words of this block (release), spin on mine (acquire), compare the fingerprints.
    0: go on; else the block stops (block 0 reports a MISMATCH; a timeout or abort is
    reported by the block that saw it)."""
    lanes = tl.arange(0, WP)
    mask = lanes < W
    extra = 4096 + (blk - 1).to(tl.int64) * 1536  # BLOCKS + (b - 1) * BLOCK_STRIDE
    bar = tl.where(blk == 0, 512, extra)
    prints = tl.where(blk == 0, 2560, extra + 512) + (epoch & 1) * 512
    e = tl.zeros([WP], tl.int64) + epoch
    mine_fp = tl.zeros([WP], tl.int64) + fprint
    peers = tl.load(controls + lanes, mask=mask, other=0)
    base = tl.load(controls + rank)
    if blk == 0:
        tl.store(base.to(tl.pointer_type(tl.int64)), epoch.to(tl.int64))  # EPOCH: barriers so far
    _store_pair_release(peers + prints + rank * 8, mine_fp, peers + bar + rank * 8, e, mask, INTERPRET)
    mine = base + bar + lanes * 8
    state = _spin_block(mine, mask, epoch, host, timeout_ns, max_spins, INTERPRET)
    one = tl.full([WP], 1, tl.int64) << lanes.to(tl.int64)
    if (state == 1) | (state == 2):
        late = mask & ((_load_acquire(mine, INTERPRET) - epoch) < 0)
        _give_up(host, state, op_id, 0, tl.sum(tl.where(late, one, 0)))
    elif state == 0:
        theirs = _load_acquire(base + prints + lanes * 8, INTERPRET)
        other = mask & (theirs != mine_fp)
        if tl.sum(other.to(tl.int32)) != 0:
            state = 4
            if blk == 0:
                first = tl.min(tl.where(other, lanes, WP))
                tl.store(host + 7, tl.sum(tl.where(lanes == first, theirs, 0)))  # FAIL_FP
                _give_up(host, 4, op_id, 0, tl.sum(tl.where(other, one, 0)))  # MISMATCH
    return state


@triton.jit
def _hint(ptrs, HINT: tl.constexpr):
    """``ptrs`` (a contiguous run starting 16-byte aligned), told to the compiler."""
    if HINT:
        ptrs = tl.multiple_of(ptrs, 16)
    return ptrs


@triton.jit
def _get(ptrs, mask, MASKED: tl.constexpr, PEER: tl.constexpr):
    """Load; a peer's memory bypasses L1 (written by another GPU since we last looked)."""
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
def _copy(src_addr, dst_addr, lo, hi, RAW: tl.constexpr, BLOCK: tl.constexpr, HS: tl.constexpr,
          HD: tl.constexpr, PEER: tl.constexpr):
    """dst[lo:hi] = src[lo:hi] (elements of RAW; addresses as int64)."""
    src = src_addr.to(tl.pointer_type(RAW))
    dst = dst_addr.to(tl.pointer_type(RAW))
    full = (hi - lo) // BLOCK
    for i in range(0, full):
        offs = lo + i * BLOCK + tl.arange(0, BLOCK)
        tl.store(_hint(dst + offs, HD), _get(_hint(src + offs, HS), offs < hi, False, PEER))
    tail = lo + full * BLOCK
    if tail < hi:
        offs = tail + tl.arange(0, BLOCK)
        m = offs < hi
        tl.store(_hint(dst + offs, HD), _get(_hint(src + offs, HS), m, True, PEER), mask=m)


@triton.jit
def _row_at(controls, r, slot_off, offs, mask, MASKED: tl.constexpr, DT: tl.constexpr, RAW: tl.constexpr,
            ACC: tl.constexpr, BOOL: tl.constexpr, HINT: tl.constexpr):
    row = (tl.load(controls + r) + slot_off).to(tl.pointer_type(RAW))
    x = _get(_hint(row + offs, HINT), mask, MASKED, True)
    if RAW != DT:
        x = x.to(DT, bitcast=True)
    x = x.to(ACC)
    if BOOL:
        x = (x != 0).to(ACC)
    return x


@triton.jit
def _reduce_step(controls, slot_off, offs, mask, MASKED: tl.constexpr, W: tl.constexpr, OP: tl.constexpr,
                 DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr, HINT: tl.constexpr):
    acc = _row_at(controls, 0, slot_off, offs, mask, MASKED, DT, RAW, ACC, BOOL, HINT)
    for r in tl.static_range(1, W):
        acc = _combine(acc, _row_at(controls, r, slot_off, offs, mask, MASKED, DT, RAW, ACC, BOOL, HINT), OP)
    out = acc.to(DT)
    if RAW != DT:
        out = out.to(RAW, bitcast=True)
    return out


@triton.jit
def _reduce_range(controls, slot_off, out_addr, also_addr, lo, hi, W: tl.constexpr, OP: tl.constexpr,
                  DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr,
                  BLOCK: tl.constexpr, HINT_IO: tl.constexpr, HINT_WS: tl.constexpr, ALSO: tl.constexpr):
    """out[lo:hi] = op over ranks r of slot_r[lo:hi] (rank order, in ACC); when ALSO, the
    result goes to ``also_addr`` (this rank's slot) too."""
    out = out_addr.to(tl.pointer_type(RAW))
    also = also_addr.to(tl.pointer_type(RAW))
    full = (hi - lo) // BLOCK
    for i in range(0, full):
        offs = lo + i * BLOCK + tl.arange(0, BLOCK)
        y = _reduce_step(controls, slot_off, offs, offs < hi, False, W, OP, DT, RAW, ACC, BOOL, HINT_WS)
        tl.store(_hint(out + offs, HINT_IO), y)
        if ALSO:
            tl.store(_hint(also + offs, HINT_WS), y)
    tail = lo + full * BLOCK
    if tail < hi:
        offs = tail + tl.arange(0, BLOCK)
        m = offs < hi
        y = _reduce_step(controls, slot_off, offs, m, True, W, OP, DT, RAW, ACC, BOOL, HINT_WS)
        tl.store(_hint(out + offs, HINT_IO), y, mask=m)
        if ALSO:
            tl.store(_hint(also + offs, HINT_WS), y, mask=m)


@triton.jit(do_not_specialize=["inp", "out", "slot_off", "n", "per", "op_id", "fprint", "epoch"])
def one_shot_kernel(inp, out, controls_addr, slot_off, n, per, rank, host_addr, op_id, fprint, epoch, timeout_ns,
                    max_spins, W: tl.constexpr, WP: tl.constexpr, OP: tl.constexpr, DT: tl.constexpr,
                    RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr, BLOCK: tl.constexpr,
                    HINT_IO: tl.constexpr, HINT_WS: tl.constexpr, INTERPRET: tl.constexpr):
    """One-shot all_reduce of elements [0, n) in one launch.  Block b (elements
    [b * per, (b + 1) * per)): copy them from ``inp`` into this rank's slot (at
    ``slot_off`` in its workspace), barrier of block b at ``epoch``, then
    ``out`` = op over every rank's slot, in rank order (the same bits on every rank)."""
    host = host_addr.to(tl.pointer_type(tl.int64))
    if tl.load(host + 1, volatile=True) == 0:  # STATUS: not broken
        controls = controls_addr.to(tl.pointer_type(tl.int64))
        blk = tl.program_id(0)
        lo = blk.to(tl.int64) * per
        hi = tl.maximum(tl.minimum(lo + per, n), lo)
        mine = tl.load(controls + rank) + slot_off
        _copy(inp, mine, lo, hi, RAW, BLOCK, HINT_IO, HINT_WS, False)
        tl.debug_barrier()  # every thread's copy is done before the release
        state = _block_sync(controls, rank, blk, epoch, fprint, host, op_id, timeout_ns, max_spins, W, WP,
                            INTERPRET)
        tl.debug_barrier()
        if state == 0:
            _reduce_range(controls, slot_off, out, mine, lo, hi, W, OP, DT, RAW, ACC, BOOL, BLOCK, HINT_IO,
                          HINT_WS, False)


@triton.jit(do_not_specialize=["inp", "out", "slot_off", "n", "per", "op_id", "fprint", "epoch"])
def two_shot_kernel(inp, out, controls_addr, slot_off, n, per, piece, rank, host_addr, op_id, fprint, epoch,
                    timeout_ns, max_spins, W: tl.constexpr, WP: tl.constexpr, OP: tl.constexpr, DT: tl.constexpr,
                    RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr, BLOCK: tl.constexpr,
                    HINT_IO: tl.constexpr, HINT_WS: tl.constexpr, INTERPRET: tl.constexpr):
    """Two-shot all_reduce of elements [0, n) in one launch, two barriers (epochs
    ``epoch`` and ``epoch + 1``).  Slice s = elements [s * piece, (s + 1) * piece); block
    b owns elements [b * per, (b + 1) * per) of every slice::

        copy:           my slot[every slice, my range] <- inp
        barrier 1
        reduce-scatter: my slot[slice rank] = out[slice rank] = op over r of slot_r[slice rank]
        barrier 2
        all-gather:     out[slice s] <- slot_s[slice s] for every s != rank

    Every slice is reduced once (by its owner) and copied: the same bits everywhere."""
    host = host_addr.to(tl.pointer_type(tl.int64))
    if tl.load(host + 1, volatile=True) == 0:
        controls = controls_addr.to(tl.pointer_type(tl.int64))
        blk = tl.program_id(0)
        start = blk.to(tl.int64) * per
        mine = tl.load(controls + rank) + slot_off
        for s in tl.static_range(W):
            lo = s * piece + start
            hi = tl.maximum(tl.minimum(tl.minimum(lo + per, (s + 1) * piece), n), lo)
            _copy(inp, mine, lo, hi, RAW, BLOCK, HINT_IO, HINT_WS, False)
        tl.debug_barrier()
        state = _block_sync(controls, rank, blk, epoch, fprint, host, op_id, timeout_ns, max_spins, W, WP,
                            INTERPRET)
        tl.debug_barrier()
        if state == 0:
            lo = rank * piece + start
            hi = tl.maximum(tl.minimum(tl.minimum(lo + per, (rank + 1) * piece), n), lo)
            _reduce_range(controls, slot_off, out, mine, lo, hi, W, OP, DT, RAW, ACC, BOOL, BLOCK, HINT_IO,
                          HINT_WS, True)
            tl.debug_barrier()
            state = _block_sync(controls, rank, blk, epoch + 1, fprint, host, op_id, timeout_ns, max_spins, W,
                                WP, INTERPRET)
            tl.debug_barrier()
            if state == 0:
                for s in tl.static_range(W):
                    if s != rank:
                        lo = s * piece + start
                        hi = tl.maximum(tl.minimum(tl.minimum(lo + per, (s + 1) * piece), n), lo)
                        _copy(tl.load(controls + s) + slot_off, out, lo, hi, RAW, BLOCK, HINT_WS, HINT_IO, True)
