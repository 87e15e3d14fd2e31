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
and nothing hangs.  A kernel that starts once an earlier one gave up does not spin at
all, so one failure fails the queued ops fast: it reads that from the BROKEN word of its
own workspace, where giving up also writes, not from the control page.  A read of host
memory costs microseconds and the GPU serves those of a kernel's blocks one after
another (a fused kernel of 128 blocks that each read it ran 70 times slower:
docs/results/4xh200/fused-one-gpu.txt), so kernels read the page only while a spin
lasts: a one-block kernel its ABORT word every 1024th poll, a fused kernel's blocks one
of them per HOST_POLL_NS (chorus.cuda.fused._host_turn).

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
def as_ptr(addr, T: tl.constexpr):
    """The address ``addr`` (an int, or int64 words) as a pointer to ``T``.  Through
    int64 first: Triton passes an int that fits in 32 bits as an int32, and the
    interpreter of some versions cannot widen that into a pointer (a host address
    under 2**31, as the CPU tests' buffers can have)."""
    return addr.to(tl.int64).to(tl.pointer_type(T))


@triton.jit
def now(INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.zeros([], tl.int64)
    else:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)


@triton.jit
def load_acquire(addrs, INTERPRET: tl.constexpr):
    """int64 words at ``addrs`` (a block of addresses), acquire, system scope."""
    ptrs = as_ptr(addrs, tl.int64)
    if INTERPRET:
        return tl.atomic_add(ptrs, tl.zeros(addrs.shape, tl.int64), sem="acquire", scope="sys")
    else:
        return tl.inline_asm_elementwise("ld.acquire.sys.global.b64 $0, [$1];", "=l,l", [addrs],
                                         dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _store_release(addrs, values, mask, INTERPRET: tl.constexpr):
    """``*addrs = values`` where ``mask``, release, system scope (plain stores)."""
    if INTERPRET:
        tl.atomic_xchg(as_ptr(addrs, tl.int64), values, mask=mask, sem="release", scope="sys")
    else:
        tl.inline_asm_elementwise(
            """{ .reg .pred %p; setp.ne.s32 %p, $2, 0; @%p st.release.sys.global.b64 [$1], $3; mov.u32 $0, 0; }""",
            "=r,l,r,l", [addrs, mask.to(tl.int32), values], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _store_header_release(hdr, tag, nbytes, flag, value, INTERPRET: tl.constexpr):
    """Write a channel header (tag, nbytes) at ``hdr``, then ``*flag = value`` (release):
    one thread does both, so whoever acquires the flag sees the header."""
    if INTERPRET:
        tl.store(as_ptr(hdr, tl.int64), tag)
        tl.store(as_ptr(hdr, tl.int64) + 1, nbytes)
        tl.atomic_xchg(as_ptr(flag, tl.int64), value, sem="release", scope="sys")
    else:
        tl.inline_asm_elementwise(
            """{ st.global.b64 [$1], $2; st.global.b64 [$1+8], $3;
                 st.release.sys.global.b64 [$4], $5; mov.u32 $0, 0; }""",
            "=r,l,l,l,l,l", [hdr, tag, nbytes, flag, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def store_pair_release(a_addrs, a_values, b_addrs, b_values, mask, INTERPRET: tl.constexpr):
    """``*a_addrs = a_values`` (plain), then ``*b_addrs = b_values`` (release, system
    scope), where ``mask``: both by one thread per lane, so whoever acquires b sees a."""
    if INTERPRET:
        tl.store(as_ptr(a_addrs, tl.int64), a_values, mask=mask)
        tl.atomic_xchg(as_ptr(b_addrs, tl.int64), b_values, mask=mask, sem="release", scope="sys")
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
    start = now(INTERPRET)
    while state == 0:
        late = mask & ((load_acquire(addrs, INTERPRET) - target) < 0)
        spins += 1
        if tl.sum(late.to(tl.int32)) == 0:
            state = 1
        elif spins % 32 == 0:
            if host_due(spins, INTERPRET):
                if tl.load(host + 0, volatile=True) != 0:  # ABORT
                    state = 3
            if state == 0:
                if ((now(INTERPRET) - start) > timeout_ns) | (spins >= max_spins):
                    state = 2
    return state - 1  # 0 OK, 1 TIMEOUT, 2 ABORTED (layout's codes)


@triton.jit
def host_due(spins, INTERPRET: tl.constexpr):
    """Whether a spin at poll ``spins`` (a multiple of 32) reads the host page's ABORT word:
    on a GPU every 1024th poll, from the 512th (a read of host memory costs microseconds,
    and the GPU serves the reads of a kernel's blocks one after another: none on the
    common path); under the interpreter every time."""
    if INTERPRET:
        due = spins >= 0
    else:
        due = spins % 1024 == 512
    return due


@triton.jit
def is_broken(host, mirror):
    """Whether the group is broken: the BROKEN word of my workspace (``mirror``, an int64
    address; 0: none, then the control page's STATUS, over PCIe)."""
    if mirror != 0:
        status = tl.load(as_ptr(mirror, tl.int64), volatile=True)
    else:
        status = tl.load(host + 1, volatile=True)
    return status != 0


@triton.jit
def give_up(host, mirror, state, op_id, what, peers):
    """Record why a spin gave up in the control page, STATUS last, and ``state`` in my
    workspace's BROKEN word (``mirror``; 0: none) for the kernels that follow."""
    tl.store(host + 2, op_id)  # FAIL_OP
    tl.store(host + 3, what)  # FAIL_WHAT
    tl.store(host + 4, peers)  # FAIL_PEERS
    tl.store(host + 1, state)  # STATUS
    if mirror != 0:
        tl.store(as_ptr(mirror, tl.int64), tl.zeros([], tl.int64) + state)


# -- kernels ------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["op_id", "fprint", "epoch"])
def barrier_kernel(controls, rank, host_addr, op_id, fprint, timeout_ns, max_spins, epoch,
                   W: tl.constexpr, WP: tl.constexpr, INTERPRET: tl.constexpr):
    """All W ranks: epoch e = mine + 1; store ``fprint`` into FPRINT[e % 2][rank] and then
    e into BARRIER[rank] of every rank; wait until my BARRIER[r] >= e for every r; then
    compare my FPRINT[e % 2][r] with ``fprint``.  ``controls``: int64 addresses of every
    rank's workspace (index = group rank).  ``epoch`` > 0: e itself (the executor counts
    the group's barriers, fused kernels' included); 0: e = my EPOCH word + 1."""
    host = as_ptr(host_addr, tl.int64)
    base = tl.load(controls + rank)
    mirror = base + 8  # BROKEN
    if not is_broken(host, mirror):
        lanes = tl.arange(0, WP)
        mask = lanes < W
        epoch_ptr = as_ptr(base, tl.int64)  # EPOCH = 0
        e = tl.load(epoch_ptr) + 1
        if epoch > 0:
            e = epoch.to(tl.int64)
        tl.store(epoch_ptr, e)
        prints = 2560 + (e & 1) * 512  # FPRINT of this parity
        mine_fp = tl.zeros([WP], tl.int64) + fprint
        peers = tl.load(controls + lanes, mask=mask, other=0)
        store_pair_release(peers + prints + rank * 8, mine_fp, peers + 512 + rank * 8,
                            tl.zeros([WP], tl.int64) + e, mask, INTERPRET)
        mine = base + 512 + lanes * 8  # BARRIER
        state = _spin(mine, mask, e, host, timeout_ns, max_spins, INTERPRET)
        one = tl.full([WP], 1, tl.int64) << lanes.to(tl.int64)
        if state != 0:
            late = mask & ((load_acquire(mine, INTERPRET) - e) < 0)
            give_up(host, mirror, state, op_id, 0, tl.sum(tl.where(late, one, 0)))
        else:
            theirs = load_acquire(base + prints + lanes * 8, INTERPRET)
            other = mask & (theirs != mine_fp)
            if tl.sum(other.to(tl.int32)) != 0:
                first = tl.min(tl.where(other, lanes, WP))
                tl.store(host + 7, tl.sum(tl.where(lanes == first, theirs, 0)))  # FAIL_FP
                give_up(host, mirror, 4, op_id, 0, tl.sum(tl.where(other, one, 0)))  # MISMATCH


@triton.jit(do_not_specialize=["value", "tag", "nbytes"])
def post_kernel(flag_addr, value, hdr_addr, tag, nbytes, host_addr, mirror,
                HEADER: tl.constexpr, INTERPRET: tl.constexpr):
    """``*flag_addr = value`` (release), after writing the channel header at ``hdr_addr``
    when ``HEADER``.  Skipped once the group is broken (``mirror``: my BROKEN word)."""
    host = as_ptr(host_addr, tl.int64)
    if not is_broken(host, mirror):
        one = tl.zeros([1], tl.int64)
        if HEADER:
            _store_header_release(one + hdr_addr, one + tag, one + nbytes, one + flag_addr, one + value,
                                  INTERPRET)
        else:
            _store_release(one + flag_addr, one + value, one == 0, INTERPRET)


@triton.jit(do_not_specialize=["target", "expect_tag", "expect_nbytes", "peer", "op_id"])
def wait_kernel(flag_addr, target, hdr_addr, expect_tag, expect_nbytes, peer, host_addr, mirror, op_id, what,
                timeout_ns, max_spins, HEADER: tl.constexpr, INTERPRET: tl.constexpr):
    """Wait until ``*flag_addr >= target`` (a local word that peer ``peer`` stores into);
    then, when ``HEADER``, check the sender's channel header at ``hdr_addr``: another
    size breaks the group (SIZE_MISMATCH), another tag is recorded (TAG_*)."""
    host = as_ptr(host_addr, tl.int64)
    if not is_broken(host, mirror):
        one = tl.zeros([1], tl.int64)
        state = _spin(one + flag_addr, one == 0, target, host, timeout_ns, max_spins, INTERPRET)
        if state != 0:
            give_up(host, mirror, state, op_id, what, tl.full([], 1, tl.int64) << peer)
        elif HEADER:
            hdr = as_ptr(hdr_addr, tl.int64)
            got_tag = tl.load(hdr, volatile=True)
            got_nbytes = tl.load(hdr + 1, volatile=True)
            if got_nbytes != expect_nbytes:
                tl.store(host + 5, expect_nbytes)  # FAIL_EXPECT
                tl.store(host + 6, got_nbytes)  # FAIL_GOT
                give_up(host, mirror, 3, op_id, what, tl.full([], 1, tl.int64) << peer)
            elif got_tag != expect_tag:
                tl.store(host + 9, peer)  # TAG_PEER
                tl.store(host + 10, expect_tag)  # TAG_EXPECT
                tl.store(host + 11, got_tag)  # TAG_GOT
                tl.store(host + 8, op_id + 1)  # TAG_OP, last


@triton.jit
def combine(a, b, OP: tl.constexpr):
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
def widen(x, DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr):
    """Elements as stored (``RAW``) into the accumulator's type: float8 bitcast from its
    bytes, 8- and 16-bit floats up to float32, bool bytes to 0/1."""
    if RAW != DT:
        x = x.to(DT, bitcast=True)
    x = x.to(ACC)
    if BOOL:
        x = (x != 0).to(ACC)
    return x


@triton.jit
def narrow(acc, DT: tl.constexpr, RAW: tl.constexpr):
    """An accumulator back into the elements' storage type (widen's inverse)."""
    out = acc.to(DT)
    if RAW != DT:
        out = out.to(RAW, bitcast=True)
    return out


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
        acc = combine(acc, _load_row(rows, r, offset, offs, mask, DT, RAW, ACC, BOOL), OP)
    tl.store(as_ptr(out_addr, RAW) + offs, narrow(acc, DT, RAW), mask=mask)


@triton.jit
def _load_row(rows, r, offset, offs, mask, DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr,
              BOOL: tl.constexpr):
    row = as_ptr(tl.load(rows + r) + offset, RAW)
    return widen(tl.load(row + offs, mask=mask, other=0), DT, RAW, ACC, BOOL)
