"""The Triton kernels of chorus.cuda: a barrier, a flag post and a flag wait (the channel
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

from chorus.cuda import layout as L

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
@triton.jit(do_not_specialize=["op_id", "fprint"])
def barrier_kernel(controls, rank, host_addr, op_id, fprint, timeout_ns, max_spins,
                   W: tl.constexpr, WP: tl.constexpr, INTERPRET: tl.constexpr):
    """All W ranks: epoch e = mine + 1; store ``fprint`` into FPRINT[e % 2][rank] and then
    e into BARRIER[rank] of every rank; wait until my BARRIER[r] >= e for every r; then
    compare my FPRINT[e % 2][r] with ``fprint``.  ``controls``: int64 addresses of every
    rank's workspace (index = group rank)."""
    host = host_addr.to(tl.pointer_type(tl.int64))
    if tl.load(host + 1, volatile=True) == 0:  # STATUS: not broken
        lanes = tl.arange(0, WP)
        mask = lanes < W
        base = tl.load(controls + rank)
        epoch_ptr = base.to(tl.pointer_type(tl.int64))  # EPOCH = 0
        e = tl.load(epoch_ptr) + 1
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


# -- launchers (on torch's current stream of the current device) ---------------------------
def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def barrier(controls, rank: int, world: int, host_addr: int, op_id: int, timeout_ns: int,
            max_spins: int = NEVER, fprint: int = 0) -> None:
    """``fprint``: this rank's op's fingerprint (any 64-bit value; the same on every rank
    that calls the same op)."""
    barrier_kernel[(1,)](controls, rank, host_addr, op_id, signed64(fprint), timeout_ns, max_spins, W=world,
                         WP=max(2, _pow2(world)), INTERPRET=INTERPRET, num_warps=1)


def signed64(value: int) -> int:
    """``value`` (0 <= value < 2**64, or already signed) as the int64 with its bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def post(flag_addr: int, value: int, host_addr: int, hdr_addr: int = 0, tag: int = 0, nbytes: int = 0) -> None:
    post_kernel[(1,)](flag_addr, value, hdr_addr, tag, nbytes, host_addr, HEADER=hdr_addr != 0,
                      INTERPRET=INTERPRET, num_warps=1)


def wait(flag_addr: int, target: int, peer: int, host_addr: int, op_id: int, what: int, timeout_ns: int,
         hdr_addr: int = 0, tag: int = 0, nbytes: int = 0, max_spins: int = NEVER) -> None:
    wait_kernel[(1,)](flag_addr, target, hdr_addr, tag, nbytes, peer, host_addr, op_id, what, timeout_ns,
                      max_spins, HEADER=hdr_addr != 0, INTERPRET=INTERPRET, num_warps=1)


#: torch dtype name -> (element type, storage type, accumulator, bytes read as bool)
_TYPES = {
    "float32": (tl.float32, tl.float32, tl.float32, False), "float64": (tl.float64, tl.float64, tl.float64, False),
    "float16": (tl.float16, tl.float16, tl.float32, False), "bfloat16": (tl.bfloat16, tl.bfloat16, tl.float32, False),
    "float8_e4m3fn": (tl.float8e4nv, tl.uint8, tl.float32, False),
    "float8_e5m2": (tl.float8e5, tl.uint8, tl.float32, False),
    "int8": (tl.int8, tl.int8, tl.int8, False), "uint8": (tl.uint8, tl.uint8, tl.uint8, False),
    "int16": (tl.int16, tl.int16, tl.int16, False), "int32": (tl.int32, tl.int32, tl.int32, False),
    "int64": (tl.int64, tl.int64, tl.int64, False), "bool": (tl.int8, tl.int8, tl.int8, True),
}
REDUCIBLE = frozenset(_TYPES)
BLOCK = 2048


def reduce(rows, offset: int, out_addr: int, n: int, world: int, op: str, dtype: str) -> None:
    """Launch reduce_kernel over ``n`` elements of dtype (a torch dtype name)."""
    if n == 0:
        return
    dt, raw, acc, is_bool = _TYPES[dtype]
    op = {"AVG": "SUM", "PREMUL_SUM": "SUM"}.get(op, op)
    if is_bool:
        op = {"SUM": "BOR", "MAX": "BOR", "PRODUCT": "BAND", "MIN": "BAND"}.get(op, op)
    reduce_kernel[(triton.cdiv(n, BLOCK),)](rows, offset, out_addr, n, W=world, OP=op, DT=dt, RAW=raw,
                                           ACC=acc, BOOL=is_bool, BLOCK=BLOCK, num_warps=8)


assert (L.BARRIER, L.STATUS, L.FAIL_OP, L.FAIL_WHAT, L.FAIL_PEERS, L.ABORT) == (512, 1, 2, 3, 4, 0), \
    "the kernels hard-code these offsets"
assert (L.FAIL_EXPECT, L.FAIL_GOT, L.TAG_OP, L.TAG_PEER, L.TAG_EXPECT, L.TAG_GOT) == (5, 6, 8, 9, 10, 11)
assert (L.FPRINT, L.FPRINT_PARITY, L.FAIL_FP, L.MISMATCH) == (2560, 512, 7, 4)
