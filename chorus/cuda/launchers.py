"""Host-side launches of chorus.cuda's Triton kernels (chorus.cuda.kernels, chorus.cuda.fused), on torch's
current stream of the current device: the barrier, the channel's post and wait, the
reduction of W rows, the fused one-shot and two-shot all_reduce, and the cached launch
path that skips Triton's per-call argument binding.  chorus.cuda.lanes calls these (tests
pass stand-ins with the same names that run on the CPU)."""

from __future__ import annotations

import logging
import threading

import triton
import triton.language as tl

from chorus import config
from chorus.cuda import layout as L
from chorus.cuda.algorithms import GATHER_ITEMS
from chorus.cuda.direct import DirectLaunch, LaunchFailed
from chorus.cuda.fused import one_shot_kernel, two_shot_kernel, two_shot_stores_kernel
from chorus.cuda.gather import all_gather_kernel, reduce_scatter_kernel
from chorus.cuda.kernels import (
    INTERPRET,
    NEVER,
    barrier_kernel,
    post_kernel,
    reduce_kernel,
    wait_kernel,
)

log = logging.getLogger("chorus")

__all__ = ["INTERPRET", "NEVER"]  # re-exported: callers of the launchers use them too


_KEY_THREAD: list[threading.Thread] = []  # warm_keys' started threads, until a launch has waited for them
_KEY_LOCK = threading.Lock()


def warm_keys():
    """Start what Triton's first launch in a process computes before it can look in its
    kernel cache, a hash of Triton's own files (0.24 s of a group's 0.57 s workspace
    check on the 4 x H200 host: docs/results/4xh200/broadcast-handoff/setup-profile.txt),
    on a thread of its own, so that it overlaps the workspace's set-up and what the
    caller does next.  chorus's first launch through Triton waits for it, and so does
    the returned wait (code outside chorus that uses Triton meanwhile computes the same
    cached value).  Nothing to do under the interpreter, where this Triton computes no
    such hash, or once it is computed."""
    key = None if INTERPRET else getattr(getattr(triton.runtime, "cache", None), "triton_key", None)
    info = getattr(key, "cache_info", None)
    if key is None or (info is not None and info().currsize):
        return _keyed

    def compute() -> None:
        try:
            key()
        except Exception as exc:  # noqa: BLE001 - the first launch computes it again and raises there
            log.debug("chorus.cuda: computing Triton's key ahead failed: %s: %s", type(exc).__name__, exc)

    thread = threading.Thread(target=compute, name="chorus-triton-key", daemon=True)
    thread.start()  # (listed once started: a launch may join it at once)
    with _KEY_LOCK:
        _KEY_THREAD.append(thread)
    return _keyed


def _keyed() -> None:
    """Wait for warm_keys' threads (before a launch through Triton)."""
    while _KEY_THREAD:
        with _KEY_LOCK:
            if not _KEY_THREAD:
                return
            thread = _KEY_THREAD[0]
        thread.join()
        with _KEY_LOCK:
            if thread in _KEY_THREAD:
                _KEY_THREAD.remove(thread)


# -- launchers (on torch's current stream of the current device) ---------------------------
def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def barrier(controls, rank: int, world: int, host_addr: int, op_id: int, timeout_ns: int,
            max_spins: int = NEVER, fprint: int = 0, epoch: int = 0, stream: int | None = None) -> None:
    """``fprint``: this rank's op's fingerprint (any 64-bit value; the same on every rank
    that calls the same op); ``epoch``: the barrier's epoch (0: the EPOCH word + 1)."""
    fprint = signed64(fprint)
    key = ("barrier", controls.data_ptr(), rank, world, host_addr, timeout_ns, max_spins, _fits(op_id),
           _fits(fprint), _fits(epoch))
    launch(barrier_kernel, key, 1, (controls, rank, host_addr, op_id, fprint, timeout_ns, max_spins, epoch,
                                    world, max(2, _pow2(world)), INTERPRET), 1, stream)


def signed64(value: int) -> int:
    """``value`` (0 <= value < 2**64, or already signed) as the int64 with its bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def post(flag_addr: int, value: int, host_addr: int, hdr_addr: int = 0, tag: int = 0, nbytes: int = 0,
         mirror_addr: int = 0) -> None:
    """``mirror_addr``: this rank's BROKEN word (0: the kernel reads the control page)."""
    _keyed()
    post_kernel[(1,)](flag_addr, value, hdr_addr, tag, nbytes, host_addr, mirror_addr, HEADER=hdr_addr != 0,
                      INTERPRET=INTERPRET, num_warps=1)


def wait(flag_addr: int, target: int, peer: int, host_addr: int, op_id: int, what: int, timeout_ns: int,
         hdr_addr: int = 0, tag: int = 0, nbytes: int = 0, max_spins: int = NEVER, mirror_addr: int = 0) -> None:
    """``mirror_addr``: as post's."""
    _keyed()
    wait_kernel[(1,)](flag_addr, target, hdr_addr, tag, nbytes, peer, host_addr, mirror_addr, op_id, what,
                      timeout_ns, max_spins, HEADER=hdr_addr != 0, INTERPRET=INTERPRET, num_warps=1)


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


def _ops(op: str, dtype: str) -> tuple:
    """(DT, RAW, ACC, BOOL, OP) of the reduce kernels for reduce op ``op`` on ``dtype``."""
    dt, raw, acc, is_bool = _TYPES[dtype]
    op = {"AVG": "SUM", "PREMUL_SUM": "SUM"}.get(op, op)
    if is_bool:
        op = {"SUM": "BOR", "MAX": "BOR", "PRODUCT": "BAND", "MIN": "BAND"}.get(op, op)
    return dt, raw, acc, is_bool, op


def reduce(rows, offset: int, out_addr: int, n: int, world: int, op: str, dtype: str,
           stream: int | None = None) -> None:
    """Launch reduce_kernel over ``n`` elements of dtype (a torch dtype name)."""
    if n == 0:
        return
    dt, raw, acc, is_bool, op = _ops(op, dtype)
    args = (rows, offset, out_addr, n, world, op, dt, raw, acc, is_bool, BLOCK)
    key = ("reduce", rows.data_ptr(), _spec(offset), _spec(out_addr), _spec(n), world, op, dtype)
    launch(reduce_kernel, key, triton.cdiv(n, BLOCK), args, 8, stream)


#: elements a thread of a fused kernel moves per step (a block's step: 256 x its warps)
PER_THREAD = 8
#: vectorisation hints in the fused kernels (CHORUS_CUDA_HINTS=0: none, for a compiler that
#: refuses them; a compile failure with hints also retries without)
HINTS = config.get("CHORUS_CUDA_HINTS")


_PLANS: dict = {}  # all_reduce_fused's per-shape launch plans
#: the fused all_reduce kernels by name (chorus.cuda.fused)
FUSED_KINDS = ("one_shot", "two_shot", "two_shot_push", "two_shot_stores")
_SMALL = (1 << 31) - 2


def all_reduce_fused(kind: str, inp: int, out: int, n: int, controls_addr: int, slot_off: int, rank: int,
                     world: int, host_addr: int, op_id: int, fprint: int, epoch: int, timeout_ns: int, op: str,
                     dtype: str, max_spins: int = NEVER, stream: int | None = None, warps: int = 4,
                     blocks: int = L.MAX_BLOCKS, per_thread: int = PER_THREAD, graph_slot: int = 0,
                     replay: bool = False) -> int:
    """Launch the one-shot (``kind`` "one_shot") or two-shot ("two_shot"; "two_shot_push":
    its all-gather by stores; "two_shot_stores": both halves by stores, through a slot
    twice the message's size) all_reduce kernel of ``n`` elements from
    ``inp`` into ``out`` (addresses on this device) through this rank's slot at
    ``slot_off``; its barriers are epochs ``epoch`` (and ``epoch`` + 1: two-shot).
    Returns the number of barriers it uses (1 or 2).  ``warps`` per block (at least
    ``world`` threads), at most ``blocks`` blocks, ``per_thread`` elements a thread per
    step (a power of two).  ``graph_slot`` > 0: the launch is captured in a CUDA graph;
    ``slot_off`` is then graph slot 0's and ``epoch`` unused (the kernel reads both from
    the device: chorus.cuda.fused.graph_begin), ``graph_slot`` the bytes of one graph slot.
    ``replay``: the kernel of a lane's replay (chorus.cuda.replays): eager, but its epoch
    from the device's EPOCH word (``epoch`` unused) and its op id ``op_id`` + that epoch.
    What depends only on the shape is planned once (geometry, types, the launch key's
    fixed part)."""
    aligned = not (inp | out) & 15
    pkey = (kind, n, dtype, op, world, aligned, controls_addr, rank, host_addr, timeout_ns, max_spins, HINTS, warps,
            blocks, per_thread, 2 if replay else int(graph_slot > 0))
    plan = _PLANS.get(pkey)
    if plan is None:
        plan = _fused_plan(pkey)
    kernel, grid, head, tail, barriers = plan
    fprint = fprint - (1 << 64) if fprint >= 1 << 63 else fprint
    args = (inp, out, controls_addr, slot_off, *head, op_id, fprint, epoch, graph_slot, *tail)
    key = (pkey, slot_off <= _SMALL, op_id <= _SMALL, epoch <= _SMALL, _fits(fprint))
    try:
        launch(kernel, key, grid, args, warps, stream)
    except Exception as exc:  # noqa: BLE001 - a compiler that refuses the hints: once more without
        if not HINTS or key in _COMPILED:
            raise
        _no_hints(exc)
        return all_reduce_fused(kind, inp, out, n, controls_addr, slot_off, rank, world, host_addr, op_id, fprint,
                                epoch, timeout_ns, op, dtype, max_spins, stream, warps, blocks, per_thread, graph_slot,
                                replay)
    return barriers


class Shot:
    """One fused launch of a fixed plan on a fixed group, with everything but the
    addresses, the slot, the op id and the epoch worked out once (a lane's repeated call:
    chorus.cuda.lanes.Lanes.shot): an all_reduce of (``kind``, ``n``, dtype, op), as
    all_reduce_fused makes it, or a round of all_gather / reduce_scatter (``kind``) of
    fixed shapes, as rows_fused makes it.  On the driver it has a parameter block of its
    own in which a call writes those five values (``where``: their places in the
    kernel's arguments, ``template``).  A call launches and returns the barriers it
    used, or 0, with nothing launched, where its values fall outside the compiled
    kernel's specialisation (unaligned addresses, 64-bit ids): the plan's launch
    function then.  Calls must not overlap (the lane's lock)."""

    __slots__ = ("kind", "n", "kernel", "key", "grid", "barriers", "template", "where", "warps", "block", "slots",
                 "replays")

    def __init__(self, kind: str, n: int, kernel, key: tuple, grid: int, barriers: int, template: tuple,
                 where: tuple, warps: int, direct):
        self.kind, self.n, self.kernel, self.key = kind, n, kernel, key
        self.grid, self.barriers, self.template, self.where, self.warps = grid, barriers, template, where, warps
        self.block = self.slots = None
        self.replays = None  # its CUDA graphs (chorus.cuda.replays), made by the lane that repeats it
        if direct is not None:
            self.block = direct.block(template)
            self.slots = tuple(self.block.slot[i] for i in where)

    def args(self, inp: int, out: int, slot_off: int, op_id: int, epoch: int) -> tuple:
        """The kernel's arguments for these five values."""
        args = list(self.template)
        for at, value in zip(self.where, (inp, out, slot_off, op_id, epoch), strict=True):
            args[at] = value
        return tuple(args)

    def __call__(self, inp: int, out: int, slot_off: int, op_id: int, epoch: int, stream: int) -> int:
        if (inp | out) & 15 or op_id > _SMALL or epoch > _SMALL or slot_off > _SMALL:
            return 0
        block = self.block
        if block is not None:
            values, (a, b, c, d, e) = block.values, self.slots
            values[a], values[b], values[c], values[d], values[e] = inp, out, slot_off, op_id, epoch
            try:
                block(self.grid, stream)
                return self.barriers
            except LaunchFailed:  # nothing enqueued: launch() below (Triton's JIT)
                self.block = None
        launch(self.kernel, self.key, self.grid, self.args(inp, out, slot_off, op_id, epoch), self.warps, stream)
        return self.barriers

    @property
    def fprint(self) -> int:
        """The fingerprint its launches carry (the argument after the op id)."""
        return self.template[self.where[3] + 1]

    def replay_key(self) -> tuple:
        """The launch key of this Shot's replay kernel (as replay() plans it now: the
        hints may have been turned off since)."""
        pkey = self.key[0]
        if self.kind in FUSED_KINDS:
            pkey = (*pkey[:11], HINTS, *pkey[12:15], 2)
        else:
            pkey = (*pkey[:15], HINTS, *pkey[16:18], 2)
        return pkey, self.key[1], False, True, self.key[4]


#: the places of (inp, out, slot_off, op_id, epoch) in a fused kernel's arguments, by the
#: length of its plan's head: (inp, out, controls, slot_off, *head, op_id, fprint, epoch, ...)
def _where(head: int) -> tuple:
    return 0, 1, 3, 4 + head, 6 + head


def fused_shot(kind: str, n: int, controls_addr: int, rank: int, world: int, host_addr: int, fprint: int,
               timeout_ns: int, op: str, dtype: str, max_spins: int = NEVER, warps: int = 4,
               blocks: int = L.MAX_BLOCKS, per_thread: int = PER_THREAD) -> Shot | None:
    """The Shot of all_reduce_fused(``kind``, ``n``, ...) on 16-byte-aligned addresses,
    once such a launch has been compiled and cached (None before, and where launches go
    through Triton's JIT each time)."""
    pkey = (kind, n, dtype, op, world, True, controls_addr, rank, host_addr, timeout_ns, max_spins, HINTS, warps,
            blocks, per_thread, 0)
    return _shot(kind, n, pkey, fprint, warps, lambda fp, head, tail: (0, 0, controls_addr, 0, *head, 0, fp, 0, 0,
                                                                      *tail))


def rows_shot(kind: str, m: int, stride: int, big_n: int, controls_addr: int, rank: int, world: int,
              host_addr: int, fprint: int, timeout_ns: int, op: str, dtype: str, item: int, max_spins: int = NEVER,
              warps: int = 4, blocks: int = L.MAX_BLOCKS) -> Shot | None:
    """The Shot of rows_fused(``kind``, ``m``, ...) on 16-byte-aligned addresses, once
    such a launch has been compiled and cached (else None, as fused_shot)."""
    pkey = (kind, m, stride, big_n, dtype, item, op, world, *_aligned(kind, 0, 0, big_n), controls_addr, rank,
            host_addr, timeout_ns, max_spins, HINTS, warps, blocks, 0)
    return _shot(kind, m, pkey, fprint, warps, lambda fp, head, tail: (0, 0, controls_addr, 0, *head, 0, fp, 0,
                                                                      *tail))


def _shot(kind: str, n: int, pkey: tuple, fprint: int, warps: int, template) -> Shot | None:
    """The Shot of the launch planned under ``pkey`` (32-bit slot, op id and epoch), its
    arguments ``template(fingerprint, head, tail)``; None before that launch was compiled
    and cached."""
    plan = _PLANS.get(pkey)
    fprint = fprint - (1 << 64) if fprint >= 1 << 63 else fprint
    key = (pkey, True, True, True, _fits(fprint))
    entry = _COMPILED.get(key) if FAST else None
    if plan is None or not entry:
        return None
    kernel, grid, head, tail = plan[:4]
    barriers = plan[4] if len(plan) > 4 else 1  # (a rows round: one barrier)
    return Shot(kind, n, kernel, key, grid, barriers, template(fprint, head, tail), _where(len(head)), warps,
                entry[3])


def replay(shot: Shot, inp: int, out: int, slot_off: int, stream: int) -> int:
    """Launch ``shot``'s op from ``inp`` into ``out`` through the slot at ``slot_off`` as
    its replay kernel (chorus.cuda.replays: the epoch from the device, the op id
    L.REPLAY_OP + that epoch); returns the barriers it used."""
    pkey, fprint = shot.key[0], shot.fprint
    if shot.kind in FUSED_KINDS:
        kind, n, dtype, op, world, _, controls, rank, host, timeout_ns, max_spins, _, warps, blocks, per_thread, _ = \
            pkey
        return all_reduce_fused(kind, inp, out, n, controls, slot_off, rank, world, host, L.REPLAY_OP, fprint, 0,
                                timeout_ns, op, dtype, max_spins, stream, warps, blocks, per_thread, replay=True)
    kind, m, stride, big_n, dtype, item, op, world, _, _, controls, rank, host, timeout_ns, max_spins, _, warps, \
        blocks, _ = pkey
    return rows_fused(kind, inp, out, m, stride, big_n, controls, slot_off, rank, world, host, L.REPLAY_OP, fprint, 0,
                      timeout_ns, op, dtype, item, max_spins, stream, warps, blocks, replay=True)


def replay_block(shot: Shot, inp: int, out: int, slot_off: int):
    """A parameter block (chorus.cuda.direct.Block) of the launch replay() makes, once
    that launch was compiled and goes straight to the driver; else None."""
    key = shot.replay_key()
    plan, entry = _PLANS.get(key[0]), _COMPILED.get(key)
    if plan is None or not entry or entry[3] is None:
        return None
    args, tail = shot.args(inp, out, slot_off, L.REPLAY_OP, 0), plan[3]
    return entry[3].block((*args[:len(args) - len(tail)], *tail))  # (the replay plan's constants)


def _fused_plan(pkey: tuple) -> tuple:
    kind, n, dtype, op, world, aligned, controls_addr, rank, host_addr, timeout_ns, max_spins, hints, warps, blocks, \
        per_thread, graph = pkey
    if len(_PLANS) >= 4096:
        _PLANS.clear()
    if warps * 32 < world or not 1 <= blocks <= L.MAX_BLOCKS:
        raise ValueError(f"a fused all_reduce of {world} ranks needs {world} threads a block and 1..{L.MAX_BLOCKS} "
                         f"blocks, not {warps} warps and {blocks} blocks")
    if kind not in FUSED_KINDS:
        raise ValueError(f"no fused all_reduce kernel {kind!r}: {', '.join(FUSED_KINDS)}")
    if per_thread < 1 or per_thread & (per_thread - 1):
        raise ValueError(f"a fused kernel's thread moves a power of two of elements a step, not {per_thread}")
    dt, raw, acc, is_bool, red = _ops(op, dtype)
    wp = max(2, _pow2(world))
    step = 32 * per_thread * warps
    tail = (timeout_ns, max_spins, world, wp, red, dt, raw, acc, is_bool, step, hints and aligned, hints, INTERPRET,
            graph)
    if kind == "one_shot":
        grid, per = L.one_shot_geometry(n, blocks, step)
        plan = (one_shot_kernel, grid, (n, per, rank, host_addr), tail, 1)
    elif kind == "two_shot_stores":
        grid, per, piece = L.two_shot_geometry(n, world, blocks, step)
        plan = (two_shot_stores_kernel, grid, (n, per, piece, rank, host_addr), tail, 2)
    else:
        grid, per, piece = L.two_shot_geometry(n, world, blocks, step)
        plan = (two_shot_kernel, grid, (n, per, piece, rank, host_addr), (*tail, kind == "two_shot_push"), 2)
    _PLANS[pkey] = plan
    return plan


#: element size -> how all_gather moves elements of a dtype it needs not reduce
_RAW_BY_SIZE = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def rows_fused(kind: str, inp: int, out: int, m: int, stride: int, big_n: int, controls_addr: int, slot_off: int,
               rank: int, world: int, host_addr: int, op_id: int, fprint: int, epoch: int, timeout_ns: int, op: str,
               dtype: str, item: int, max_spins: int = NEVER, stream: int | None = None, warps: int = 4,
               blocks: int = L.MAX_BLOCKS, replay: bool = False) -> int:
    """Launch one round of the fused ``kind`` ("all_gather" or "reduce_scatter",
    chorus.cuda.gather): ``m`` elements of each rank's block, rows ``stride`` elements
    apart in the slot at ``slot_off``, blocks of ``big_n`` elements in the op's
    W-block buffer; ``inp``/``out`` already point at the round's first element.  One
    barrier, at ``epoch``; returns 1.  ``replay``: a lane's replay kernel, as
    all_reduce_fused's."""
    pkey = (kind, m, stride, big_n, dtype, item, op, world, *_aligned(kind, inp, out, big_n), controls_addr, rank,
            host_addr, timeout_ns, max_spins, HINTS, warps, blocks, 2 if replay else 0)
    plan = _PLANS.get(pkey)
    if plan is None:
        plan = _rows_plan(pkey)
    kernel, grid, head, tail = plan
    fprint = fprint - (1 << 64) if fprint >= 1 << 63 else fprint
    args = (inp, out, controls_addr, slot_off, *head, op_id, fprint, epoch, *tail)
    launch(kernel, (pkey, slot_off <= _SMALL, op_id <= _SMALL, epoch <= _SMALL, _fits(fprint)), grid, args,
           warps, stream)
    return 1


def _aligned(kind: str, inp: int, out: int, big_n: int) -> tuple[bool, bool]:
    """Whether a round's input and output are 16-byte aligned at every block's start
    (the W-block side moves by ``big_n`` elements a block)."""
    even = big_n % L.GRAIN == 0
    return not inp & 15 and (kind == "all_gather" or even), not out & 15 and (kind == "reduce_scatter" or even)


def _rows_plan(pkey: tuple) -> tuple:
    kind, m, stride, big_n, dtype, item, op, world, aligned_in, aligned_out, controls_addr, rank, host_addr, \
        timeout_ns, max_spins, hints, warps, blocks, graph = pkey
    if len(_PLANS) >= 4096:
        _PLANS.clear()
    if warps * 32 < world or not 1 <= blocks <= L.MAX_BLOCKS:
        raise ValueError(f"a fused {kind} of {world} ranks needs {world} threads a block and 1..{L.MAX_BLOCKS} "
                         f"blocks, not {warps} warps and {blocks} blocks")
    wp = max(2, _pow2(world))
    step = 32 * PER_THREAD * warps
    grid, per = L.one_shot_geometry(m, blocks, step)
    head = (m, per, stride, big_n, rank, host_addr)
    if kind == "all_gather":
        raw = _TYPES[dtype][1] if dtype in _TYPES else _RAW_BY_SIZE[item]
        tail = (timeout_ns, max_spins, world, wp, raw, step, hints and aligned_in, hints and aligned_out, hints,
                INTERPRET, graph)
        plan = (all_gather_kernel, grid, head, tail)
    else:
        dt, raw, acc, is_bool, red = _ops(op, dtype)
        tail = (timeout_ns, max_spins, world, wp, red, dt, raw, acc, is_bool, step, hints and aligned_in,
                hints and aligned_out, hints, INTERPRET, graph)
        plan = (reduce_scatter_kernel, grid, head, tail)
    _PLANS[pkey] = plan
    return plan


def _no_hints(exc: BaseException) -> None:
    global HINTS
    HINTS = False
    _PLANS.clear()
    log.warning("chorus.cuda: compiling the fused all_reduce with vectorisation hints failed (%s: %s); "
                "compiling without them", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")


# -- the cached launch path ----------------------------------------------------------------------
# JITFunction.__call__ binds and specializes every argument on every launch (tens of
# microseconds of Python).  The first launch of each key goes through it and keeps the
# compiled kernel; later ones call its launcher directly with the same arguments.  The key
# holds every input of Triton's specialization that can change between calls (an int's
# 32/64-bit type, its divisibility by 16 and equality to 1, the constexprs), so the kept
# kernel is the one the JIT would pick.  CHORUS_CUDA_FAST_LAUNCH=0 turns it off.
FAST = config.get("CHORUS_CUDA_FAST_LAUNCH") and not INTERPRET
DIRECT = config.get("CHORUS_CUDA_DIRECT_LAUNCH")
_COMPILED: dict = {}
_I32 = (-(1 << 31), (1 << 31) - 1)


def _fits(v: int) -> bool:
    return _I32[0] <= v <= _I32[1]


def _spec(v: int) -> tuple:
    return v == 1, v % 16 == 0, _fits(v)


def _raw_stream() -> int:
    import torch

    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def launch(kernel, key, grid: int, args: tuple, num_warps: int, stream: int | None = None) -> None:
    """``kernel[(grid,)](*args, num_warps=num_warps)`` on ``stream`` (a raw
    cudaStream_t; None: torch's current stream).  ``args``: every parameter in order,
    constexprs too.  The first launch of a key goes through Triton, which launches on
    torch's current stream: another ``stream`` is made current around it (the barrier
    beside an NCCL hand-off runs on a stream of its own: chorus.cuda.beside).  Later ones
    go straight to the driver (chorus.cuda.direct) where the compiled kernel allows, else
    to Triton's launcher object."""
    entry = _COMPILED.get(key) if FAST else None
    if entry:
        run, function, packed, direct = entry
        raw = _raw_stream() if stream is None else stream
        try:
            if direct is not None:
                direct(grid, raw, args)
            else:
                run(grid, 1, 1, raw, function, packed, None, None, None, *args)
            return
        except (LaunchFailed, TypeError, ValueError, OverflowError, AttributeError) as exc:  # nothing launched
            log.warning("chorus.cuda: the cached launch of %s failed (%s: %s); launching through Triton",
                        key[0], type(exc).__name__, exc)
            _COMPILED[key] = False
            entry = False
    _keyed()
    if stream is None or INTERPRET or stream == _raw_stream():
        compiled = kernel[(grid,)](*args, num_warps=num_warps)
    else:
        import torch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            compiled = kernel[(grid,)](*args, num_warps=num_warps)
    if FAST and entry is None:
        try:
            _COMPILED[key] = (compiled.run, compiled.function, compiled.packed_metadata,
                              DirectLaunch.of(compiled, num_warps) if DIRECT else None)
        except AttributeError:  # another Triton: always through the JIT
            _COMPILED[key] = False


assert (L.BARRIER, L.BROKEN, L.STATUS, L.FAIL_OP, L.FAIL_WHAT, L.FAIL_PEERS, L.ABORT) == (512, 8, 1, 2, 3, 4, 0), \
    "the kernels hard-code these offsets"
assert (L.FAIL_EXPECT, L.FAIL_GOT, L.TAG_OP, L.TAG_PEER, L.TAG_EXPECT, L.TAG_GOT) == (5, 6, 8, 9, 10, 11)
assert (L.FPRINT, L.FPRINT_PARITY, L.FAIL_FP, L.MISMATCH) == (2560, 512, 7, 4)
assert (L.BLOCKS, L.BLOCK_STRIDE) == (4096, 1536), "the fused kernels hard-code these offsets"
assert (L.GRAPH_OPS, L.GRAPH_EPOCH, L.GRAPH_DONE, L.GRAPH_BLOCKS) == (16, 24, 32, 199168), "and these"
assert (L.HOST_POLL - L.BROKEN, L.HOST_POLL_NS) == (32, 20000), "and these (chorus.cuda.fused._host_turn)"
assert L.REPLAY_DONE == 48 and L.EPOCH == 0, "and these (chorus.cuda.fused.graph_begin, graph_end)"
assert frozenset(_RAW_BY_SIZE) == GATHER_ITEMS, "the fused all_gather's element sizes"
