"""chorus.cuda's executor (chorus.cuda.lanes.Lanes) and algorithms on the CPU: W ranks as
threads over W workspaces in host memory, with the kernels replaced by Python that keeps
their protocol (the same words, epochs and bounds), and copies by memmove.

The kernels themselves are tested under TRITON_INTERPRET (test_cuda_kernels.py); this
checks everything above them: layout, rounds and parities, chunking, offsets, the
channel counters and headers.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import torch

from chorus.cuda import layout as L
from chorus.cuda.lanes import Lanes

SPIN_S = 10.0


def word(addr: int) -> ctypes.c_int64:
    return ctypes.c_int64.from_address(addr)


def _spin(addrs, target: int, host, op_id: int, what: int, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while True:
        late = [i for i, a in enumerate(addrs) if word(a).value < target]
        if not late:
            return
        if host[L.ABORT] or time.monotonic() > end:
            host[L.FAIL_OP], host[L.FAIL_WHAT] = op_id, what
            host[L.FAIL_PEERS] = sum(1 << i for i in late)
            host[L.STATUS] = L.ABORTED if host[L.ABORT] else L.TIMEOUT
            return
        time.sleep(0)


class FakeKernels:
    """chorus.cuda.kernels' launchers, run at once on host memory."""

    def __init__(self, host: np.ndarray, timeout_s: float = SPIN_S):
        self.host = host
        self.timeout_s = timeout_s

    def barrier(self, controls, rank, world, host_addr, op_id, timeout_ns, fprint=0, epoch=0, stream=None):
        if self.host[L.STATUS]:
            return
        bases = controls.tolist()
        fprint = fprint - (1 << 64) if fprint >= 1 << 63 else fprint  # the int64 word's value
        e = epoch or word(bases[rank]).value + 1
        word(bases[rank]).value = e
        prints = L.FPRINT + (e & 1) * L.FPRINT_PARITY
        for b in bases:
            word(b + prints + 8 * rank).value = fprint
            word(b + L.BARRIER + 8 * rank).value = e
        _spin([bases[rank] + L.BARRIER + 8 * r for r in range(world)], e, self.host, op_id, L.WAIT_BARRIER,
              self.timeout_s)
        if self.host[L.STATUS]:
            return
        other = [r for r in range(world) if word(bases[rank] + prints + 8 * r).value != fprint]
        if other:
            self.host[L.FAIL_FP] = word(bases[rank] + prints + 8 * other[0]).value
            self.host[L.FAIL_OP], self.host[L.FAIL_WHAT] = op_id, L.WAIT_BARRIER
            self.host[L.FAIL_PEERS] = sum(1 << r for r in other)
            self.host[L.STATUS] = L.MISMATCH

    def post(self, flag, value, host_addr, hdr=0, tag=0, nbytes=0, mirror_addr=0):
        if self.host[L.STATUS]:
            return
        if hdr:
            word(hdr).value, word(hdr + 8).value = tag, nbytes
        word(flag).value = value

    def wait(self, flag, target, peer, host_addr, op_id, what, timeout_ns, hdr=0, tag=0, nbytes=0, mirror_addr=0):
        if self.host[L.STATUS]:
            return
        _spin([flag], target, self.host, op_id, what, self.timeout_s)
        if self.host[L.STATUS]:
            self.host[L.FAIL_PEERS] = 1 << peer
            return
        if hdr:
            got_tag, got_nbytes = word(hdr).value, word(hdr + 8).value
            if got_nbytes != nbytes:
                self.host[L.FAIL_EXPECT], self.host[L.FAIL_GOT] = nbytes, got_nbytes
                self.host[L.FAIL_OP], self.host[L.FAIL_WHAT], self.host[L.FAIL_PEERS] = op_id, what, 1 << peer
                self.host[L.STATUS] = L.SIZE_MISMATCH
            elif got_tag != tag:
                self.host[L.TAG_PEER], self.host[L.TAG_EXPECT], self.host[L.TAG_GOT] = peer, tag, got_tag
                self.host[L.TAG_OP] = op_id + 1

    def reduce(self, rows, offset, out, n, world, op, dtype, stream=None):
        if n == 0:
            return
        dt = getattr(torch, dtype)
        size = n * dt.itemsize
        views = [torch.frombuffer((ctypes.c_char * size).from_address(a + offset), dtype=dt)
                 for a in rows.tolist()]
        torch.frombuffer((ctypes.c_char * size).from_address(out), dtype=dt).copy_(reference(views, op))

    # -- the fused all_reduce kernels, block by block (the blocks of one rank in order) ------
    def all_reduce_fused(self, kind, inp, out, n, controls_addr, slot_off, rank, world, host_addr, op_id, fprint,
                         epoch, timeout_ns, op, dtype, max_spins=None, stream=None, warps=4, blocks=L.MAX_BLOCKS,
                         per_thread=8, graph_slot=0):
        barriers = 1 if kind == "one_shot" else 2
        bases = [word(controls_addr + 8 * r).value for r in range(world)]
        self.graph = graph_slot > 0
        if self.graph:  # chorus.cuda.fused.graph_begin / graph_end: the device's counts
            ops, done = word(bases[rank] + L.GRAPH_OPS), word(bases[rank] + L.GRAPH_EPOCH)
            slot_off += (ops.value & 1) * graph_slot
            epoch = done.value + 1
            ops.value += 1
            done.value += barriers
        if self.host[L.STATUS]:
            return barriers
        fprint = fprint - (1 << 64) if fprint >= 1 << 63 else fprint
        dt = getattr(torch, dtype)
        item = dt.itemsize

        def view(addr, lo, hi):
            if hi <= lo:
                return torch.empty(0, dtype=dt)
            return torch.frombuffer((ctypes.c_char * ((hi - lo) * item)).from_address(addr + lo * item), dtype=dt)

        slots = [b + slot_off for b in bases]
        if kind == "one_shot":
            count, per = L.one_shot_geometry(n, blocks, 32 * per_thread * warps)
            for b in range(count):
                lo, hi = b * per, min((b + 1) * per, n)
                view(slots[rank], lo, hi).copy_(view(inp, lo, hi))
                if not self.block_sync(bases, rank, world, b, epoch, fprint, op_id):
                    continue
                view(out, lo, hi).copy_(reference([view(s, lo, hi) for s in slots], op))
            return barriers
        count, per, piece = L.two_shot_geometry(n, world, blocks, 32 * per_thread * warps)
        if kind == "two_shot_stores":
            self.stores_blocks(inp, out, n, bases, slots, rank, world, count, per, piece, epoch, fprint, op_id, op,
                               view)
            return barriers
        for b in range(count):
            ranges = [(s * piece + b * per, min(s * piece + (b + 1) * per, (s + 1) * piece, n)) for s in range(world)]
            for lo, hi in ranges:
                view(slots[rank], lo, hi).copy_(view(inp, lo, hi))
            if not self.block_sync(bases, rank, world, b, epoch, fprint, op_id):
                continue
            lo, hi = ranges[rank]
            got = reference([view(s, lo, hi) for s in slots], op) if hi > lo else None
            push = kind == "two_shot_push"  # the reduced slice into every slot; gather from mine
            if got is not None:
                view(out, lo, hi).copy_(got)
                for q in range(world) if push else (rank,):
                    view(slots[q], lo, hi).copy_(got)
            if not self.block_sync(bases, rank, world, b, epoch + 1, fprint, op_id):
                continue
            for s, (lo, hi) in enumerate(ranges):
                if s != rank:
                    view(out, lo, hi).copy_(view(slots[rank if push else s], lo, hi))
        return barriers

    def rows_fused(self, kind, inp, out, m, stride, big_n, controls_addr, slot_off, rank, world, host_addr, op_id,
                   fprint, epoch, timeout_ns, op, dtype, item, max_spins=None, stream=None, warps=4,
                   blocks=L.MAX_BLOCKS):
        """chorus.cuda.gather's kernels, block by block: row r of a slot at r * stride."""
        if self.host[L.STATUS]:
            return 1
        bases = [word(controls_addr + 8 * r).value for r in range(world)]
        fprint = fprint - (1 << 64) if fprint >= 1 << 63 else fprint
        dt = getattr(torch, dtype) if dtype else {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[item]

        def view(addr, lo, hi):
            if hi <= lo:
                return torch.empty(0, dtype=dt)
            return torch.frombuffer((ctypes.c_char * ((hi - lo) * item)).from_address(addr + lo * item), dtype=dt)

        slots = [b + slot_off for b in bases]
        count, per = L.one_shot_geometry(m, blocks, 32 * 8 * warps)
        for b in range(count):
            lo, hi = b * per, min((b + 1) * per, m)
            if kind == "all_gather":
                for q in range(world):
                    if q != rank:
                        view(slots[q], rank * stride + lo, rank * stride + hi).copy_(view(inp, lo, hi))
                view(out, rank * big_n + lo, rank * big_n + hi).copy_(view(inp, lo, hi))
            else:
                for q in range(world):
                    view(slots[q], rank * stride + lo, rank * stride + hi).copy_(
                        view(inp, q * big_n + lo, q * big_n + hi))
            if not self.block_sync(bases, rank, world, b, epoch, fprint, op_id):
                continue
            if kind == "all_gather":
                for q in range(world):
                    if q != rank:
                        view(out, q * big_n + lo, q * big_n + hi).copy_(
                            view(slots[rank], q * stride + lo, q * stride + hi))
            elif hi > lo:
                rows = [view(slots[rank], q * stride + lo, q * stride + hi) for q in range(world)]
                view(out, lo, hi).copy_(reference(rows, op))
        return 1

    def stores_blocks(self, inp, out, n, bases, slots, rank, world, count, per, piece, epoch, fprint, op_id, op,
                      view):
        """chorus.cuda.fused.two_shot_stores_kernel, block by block: row r of a slot at
        r * piece, gather s at (W + s) * piece (elements)."""
        for b in range(count):
            ranges = [(s * piece + b * per, min(s * piece + (b + 1) * per, (s + 1) * piece, n)) for s in range(world)]
            for q, (lo, hi) in enumerate(ranges):  # my slice q into row `rank` of rank q's slot
                at = lo + (rank - q) * piece
                view(slots[q], at, at + hi - lo).copy_(view(inp, lo, hi))
            if not self.block_sync(bases, rank, world, b, epoch, fprint, op_id):
                continue
            lo, hi = ranges[rank]
            if hi > lo:
                loc = lo - rank * piece
                got = reference([view(slots[rank], r * piece + loc, r * piece + loc + hi - lo) for r in range(world)],
                                op)
                view(out, lo, hi).copy_(got)
                for q in range(world):
                    if q != rank:
                        at = (world + rank) * piece + loc
                        view(slots[q], at, at + hi - lo).copy_(got)
            if not self.block_sync(bases, rank, world, b, epoch + 1, fprint, op_id):
                continue
            for s, (lo, hi) in enumerate(ranges):
                if s != rank:
                    view(out, lo, hi).copy_(view(slots[rank], world * piece + lo, world * piece + hi))

    def block_sync(self, bases, rank, world, b, e, fprint, op_id) -> bool:
        """chorus.cuda.fused._block_sync: push (fingerprint, epoch), spin, compare."""
        if self.host[L.STATUS]:
            return False
        if getattr(self, "graph", False):
            bar, prints = L.graph_barrier(b), L.graph_fprint(b, e & 1)
        else:
            bar, prints = L.block_barrier(b), L.block_fprint(b, e & 1)
            if b == 0:
                word(bases[rank]).value = e
        for base in bases:
            word(base + prints + 8 * rank).value = fprint
            word(base + bar + 8 * rank).value = e
        _spin([bases[rank] + bar + 8 * r for r in range(world)], e, self.host, op_id, L.WAIT_BARRIER,
              self.timeout_s)
        if self.host[L.STATUS]:
            return False
        other = [r for r in range(world) if word(bases[rank] + prints + 8 * r).value != fprint]
        if other:
            if b == 0:
                self.host[L.FAIL_FP] = word(bases[rank] + prints + 8 * other[0]).value
                self.host[L.FAIL_OP], self.host[L.FAIL_WHAT] = op_id, L.WAIT_BARRIER
                self.host[L.FAIL_PEERS] = sum(1 << r for r in other)
                self.host[L.STATUS] = L.MISMATCH
            return False
        return True


def reference(rows, op: str) -> torch.Tensor:
    """op over ``rows`` in order, as the reduce kernel computes it."""
    dt = rows[0].dtype
    op = {"AVG": "SUM", "PREMUL_SUM": "SUM"}.get(op, op)
    if dt == torch.bool:
        fn = {"SUM": torch.logical_or, "MAX": torch.logical_or, "BOR": torch.logical_or,
              "PRODUCT": torch.logical_and, "MIN": torch.logical_and, "BAND": torch.logical_and,
              "BXOR": torch.logical_xor}[op]
    else:
        fn = {"SUM": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum, "MAX": torch.maximum,
              "BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    wide = dt in (torch.float16, torch.bfloat16) or dt.itemsize == 1 and dt.is_floating_point
    acc = rows[0].float() if wide else rows[0].clone()
    for r in rows[1:]:
        acc = fn(acc, r.float() if wide else r)
    return acc.to(dt)


class FakeWorkspace:
    """What Lanes reads of a chorus.cuda.workspace.Workspace, in host memory."""

    def __init__(self, rank, memories, host, layout):
        self.rank, self.world, self.layout = rank, len(memories), layout
        self.bases = [m.ctypes.data for m in memories]
        self.host_addr = host.ctypes.data
        self.words = host
        self.members = tuple(range(self.world))
        self.device = torch.device("cpu")

    @staticmethod
    def itemsize(dtype: str) -> int:
        return getattr(torch, dtype).itemsize


def memmove(dst, src, nbytes, stream):
    ctypes.memmove(dst, src, nbytes)


class Group:
    """W emulated ranks sharing host workspaces of ``total`` bytes."""

    def __init__(self, world: int, total: int):
        self.layout = L.Layout.of(world, total)
        self.memories = [np.zeros(total, np.uint8) for _ in range(world)]
        self.hosts = [np.zeros(L.CONTROL_WORDS, np.int64) for _ in range(world)]
        self.lanes = [Lanes(FakeWorkspace(r, self.memories, self.hosts[r], self.layout), 10.0,
                            kernels=FakeKernels(self.hosts[r]), memcpy=memmove) for r in range(world)]

    def run(self, fn, timeout: float = 60.0):
        """``fn(lanes)`` on every rank in threads; returns their results."""
        results, errors = [None] * len(self.lanes), []

        def body(r):
            try:
                results[r] = fn(self.lanes[r])
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(len(self.lanes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        if errors:
            raise errors[0]
        return results
