"""Fused all_gather and reduce_scatter kernels of chorus.cuda: one launch a round, in which
only stores cross the links (launched by chorus.cuda.launchers; the building blocks and
the per-block barrier are chorus.cuda.fused's).

A round moves elements [off, off + m) of each rank's block; block b of every rank handles
the same range [b * per, (b + 1) * per) of it, so block b meets only the peers' block b.
Row r of a slot holds rank r's part, ``stride`` elements apart (m rounded up to
layout.GRAIN, so every row starts 16-byte aligned)::

    all_gather      rank r: row r of every rank's slot <- input[off:off+m]   (stores)
                    barrier
                    output[q * N + off:][:m] <- row q of my slot, for q != r; my own
                    part straight from the input                             (local)

    reduce_scatter  rank r: row r of rank q's slot <- input[q * N + off:][:m], every q
                    barrier
                    output[off:][:m] = op over q of row q of my slot, in rank order
                                                                              (local)

(N: elements of one rank's block in the whole op; the output of all_gather and the input
of reduce_scatter hold W such blocks.)  Every result is a copy or one reduction in rank
order: the same bits on every rank.
"""

from __future__ import annotations

import triton
import triton.language as tl

from chorus.cuda.fused import (
    block_sync,
    copy_shifted,
    graph_begin,
    graph_end,
    kernel_start,
    put_vec,
    reduce_local_rows,
)
from chorus.cuda.kernels import as_ptr


@triton.jit(do_not_specialize=["inp", "out", "slot_off", "m", "per", "op_id", "fprint", "epoch"])
def all_gather_kernel(inp, out, controls_addr, slot_off, m, per, stride, big_n, rank, host_addr, op_id, fprint,
                      epoch, timeout_ns, max_spins, W: tl.constexpr, WP: tl.constexpr, RAW: tl.constexpr,
                      BLOCK: tl.constexpr, HINT_IN: tl.constexpr, HINT_OUT: tl.constexpr, HINT_WS: tl.constexpr,
                      INTERPRET: tl.constexpr, GRAPH: tl.constexpr):
    """One round of all_gather (module docstring): ``inp`` and ``out`` point at element
    ``off`` of this rank's input and of the output's first block; ``big_n`` = N.
    ``GRAPH`` 2: a lane's replay (chorus.cuda.fused.graph_begin: epoch and op id from the
    device); 0: eager."""
    host, controls, base, mirror, broken = kernel_start(host_addr, controls_addr, rank, INTERPRET)
    slot_off, epoch, op_id = graph_begin(base, slot_off, epoch, op_id, 0, GRAPH)
    blk = tl.program_id(0)
    lo = blk.to(tl.int64) * per
    hi = tl.maximum(tl.minimum(lo + per, m), lo)
    if not broken:  # (a broken group's kernel writes nothing into the peers' memory)
        for q in tl.static_range(W):
            if q != rank:
                copy_shifted(inp, tl.load(controls + q) + slot_off, lo, hi, 0, rank * stride, RAW, BLOCK, HINT_IN,
                             HINT_WS, False)
        copy_shifted(inp, out, lo, hi, 0, rank * big_n, RAW, BLOCK, HINT_IN, HINT_OUT, False)
        tl.debug_barrier()  # every thread's stores are done before the release
        state = block_sync(controls, rank, blk, epoch, fprint, host, mirror, op_id, timeout_ns, max_spins, W, WP,
                           INTERPRET, GRAPH)
        tl.debug_barrier()
        if state == 0:
            mine = base + slot_off
            for q in tl.static_range(W):
                if q != rank:
                    copy_shifted(mine, out, lo, hi, q * stride, q * big_n, RAW, BLOCK, HINT_WS, HINT_OUT, True)
    graph_end(base, epoch, 1, GRAPH)


@triton.jit
def _reduce_rows_into(mine_addr, out_addr, lo, hi, stride, MASKED: tl.constexpr, W: tl.constexpr,
                      OP: tl.constexpr, DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr,
                      BLOCK: tl.constexpr, HINT_OUT: tl.constexpr, HINT_WS: tl.constexpr):
    """out[lo:lo + BLOCK] (those < ``hi``) = op over q of row q of my slot (local reads)."""
    offs = lo + tl.arange(0, BLOCK)
    msk = offs < hi
    y = reduce_local_rows(mine_addr, offs, stride, msk, MASKED, W, OP, DT, RAW, ACC, BOOL, HINT_WS)
    put_vec(as_ptr(out_addr, RAW), offs, y, msk, MASKED, HINT_OUT)


@triton.jit(do_not_specialize=["inp", "out", "slot_off", "m", "per", "op_id", "fprint", "epoch"])
def reduce_scatter_kernel(inp, out, controls_addr, slot_off, m, per, stride, big_n, rank, host_addr, op_id, fprint,
                          epoch, timeout_ns, max_spins, W: tl.constexpr, WP: tl.constexpr, OP: tl.constexpr,
                          DT: tl.constexpr, RAW: tl.constexpr, ACC: tl.constexpr, BOOL: tl.constexpr,
                          BLOCK: tl.constexpr, HINT_IN: tl.constexpr, HINT_OUT: tl.constexpr,
                          HINT_WS: tl.constexpr, INTERPRET: tl.constexpr, GRAPH: tl.constexpr):
    """One round of reduce_scatter (module docstring): ``inp`` and ``out`` point at element
    ``off`` of the input's first block and of this rank's output; ``big_n`` = N.
    ``GRAPH``: as all_gather_kernel's."""
    host, controls, base, mirror, broken = kernel_start(host_addr, controls_addr, rank, INTERPRET)
    slot_off, epoch, op_id = graph_begin(base, slot_off, epoch, op_id, 0, GRAPH)
    blk = tl.program_id(0)
    lo = blk.to(tl.int64) * per
    hi = tl.maximum(tl.minimum(lo + per, m), lo)
    if not broken:
        for q in tl.static_range(W):
            copy_shifted(inp, tl.load(controls + q) + slot_off, lo, hi, q * big_n, rank * stride, RAW, BLOCK, HINT_IN,
                         HINT_WS, False)
        tl.debug_barrier()
        state = block_sync(controls, rank, blk, epoch, fprint, host, mirror, op_id, timeout_ns, max_spins, W, WP,
                           INTERPRET, GRAPH)
        tl.debug_barrier()
        if state == 0:
            mine = base + slot_off
            full = (hi - lo) // BLOCK
            for i in range(0, full):
                _reduce_rows_into(mine, out, lo + i * BLOCK, hi, stride, False, W, OP, DT, RAW, ACC, BOOL, BLOCK,
                                  HINT_OUT, HINT_WS)
            if lo + full * BLOCK < hi:
                _reduce_rows_into(mine, out, lo + full * BLOCK, hi, stride, True, W, OP, DT, RAW, ACC, BOOL, BLOCK,
                                  HINT_OUT, HINT_WS)
    graph_end(base, epoch, 1, GRAPH)
