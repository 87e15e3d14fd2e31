"""The executor the algorithms of chorus.cuda.algorithms run on: copies, kernels and
flags of one rank over its group's workspace, enqueued on one CUDA stream.

Nothing here waits on the host: every method enqueues (copy engine or Triton kernel) on
the stream the op runs on (the caller's current stream) and returns.

Recorder events (``cuda`` component; ``copy``, ``reduce``, ``sync``) carry enqueue
times: ``start``/``end`` bracket the host-side enqueue of the copy or kernel, not its
execution on the GPU (which would need an event per transfer, read later).
"""

from __future__ import annotations

import ctypes
import time

from chorus import config, recorder
from chorus.cuda import layout as L
from chorus.cuda import runtime

#: the Shots a group's lanes keep (one per plan) before the cache starts over
SHOTS = 256


class Lanes:
    """Rank ``rank``'s executor over ``workspace`` (a chorus.cuda.workspace.Workspace).

    ``kernels`` and ``memcpy`` default to chorus.cuda.launchers and
    chorus.cuda.runtime.memcpy_async; tests pass stand-ins that run on the CPU.
    ``names``: the group's OpNames (chorus.cuda.failures), where replayed kernels' op ids
    are noted (None: no replays)."""

    def __init__(self, workspace, timeout_s: float, kernels=None, memcpy=runtime.memcpy_async, names=None):
        import torch

        if kernels is None:
            from chorus.cuda import launchers as kernels
        self.k = kernels
        self.memcpy = memcpy
        self.ws = workspace
        self.rank = workspace.rank
        self.world = workspace.world
        self.layout = workspace.layout
        self.slot_offs = (self.layout.slot_at(0), self.layout.slot_at(1))  # (a round's slot, by parity)
        self.bases = workspace.bases  # every rank's workspace address, mapped here
        self.host = workspace.host_addr
        dev = workspace.device
        self.controls = torch.tensor(self.bases, dtype=torch.int64, device=dev)
        self.controls_addr = self.controls.data_ptr()
        self.rows = [torch.tensor([b + self.layout.slot_at(p) for b in self.bases], dtype=torch.int64,
                                  device=dev) for p in (0, 1)]
        self.timeout_ns = int(timeout_s * 1e9)
        # the fused all_reduce kernels' shape: warps a block (at least a thread per rank), blocks
        self.fused = (max(config.get("CHORUS_CUDA_FUSED_WARPS"), -(-self.world // 32)),
                      config.get("CHORUS_CUDA_FUSED_BLOCKS"))
        per_thread = config.get("CHORUS_CUDA_TWO_SHOT_PER_THREAD")
        if per_thread & (per_thread - 1):
            raise ValueError(f"CHORUS_CUDA_TWO_SHOT_PER_THREAD={per_thread}: a power of two is needed "
                             "(the kernels' step is 32 x warps x this many elements); e.g. 8, 16 or 32, "
                             "or 0 (by size)")
        self.two_shot_per_thread = per_thread  # 0: the algorithm's choice by size
        # the op being enqueued is captured in a CUDA graph: its kernels count rounds and
        # epochs on the device, through the graph slots (chorus.cuda.fused.graph_begin)
        self.graph = False
        self.rounds = 0
        # barriers enqueued so far (every rank enqueues the same ones: the epochs agree;
        # the workspace's check makes none)
        self.epoch = 0
        self.sent = [0] * self.world  # chunks posted to each peer's channel, ever
        self.received = [0] * self.world  # chunks taken from each peer's channel, ever
        # the op being enqueued (begin())
        self.op_id = 0
        self.ctx = None
        self.stream = 0
        self.dtype = ""
        self.reduce_op = ""
        self.fprint = 0
        # an event the next op's stream waits for first: the barrier beside an NCCL
        # hand-off (chorus.cuda.beside), so that barriers run in epoch order
        self.follow = None
        # NCCL's last op that no stream of chorus's waits for (an async hand-off): a
        # function that makes the stream beside wait for it and returns the event after
        # that; the next op on chorus's kernels calls it first (begin), so that op runs
        # after NCCL's, as ops of one ProcessGroupNCCL do, while hand-offs in a row (NCCL
        # orders its own ops) pay nothing for it
        self.unjoined = None
        # repeated all_reduces' launches, by the caller's plan (chorus.cuda.component)
        self.shots: dict = {}
        # their CUDA graphs (chorus.cuda.replays: each Shot's own), the driver that makes
        # them and a stream to capture them on (made with the first)
        self.replay = config.get("CHORUS_CUDA_REPLAY") and not getattr(kernels, "INTERPRET", True)
        self.names = names
        self.graphs = None
        self.capture_stream = None
        self.stream_arg = (None, None)  # (raw stream, its ctypes argument) of replay_kept's last launch

    def begin(self, op_id: int, ctx, stream: int, dtype: str = "", reduce_op: str = "", fprint: int = 0,
              joins: bool = True) -> None:
        """Enqueue the next op's work on ``stream`` (a raw cudaStream_t); its barriers carry
        ``fprint`` (the Call's fingerprint, compared with every peer's: chorus.cuda.kernels),
        after ``follow`` if set, and (``joins``: an op on chorus's kernels, not the barrier
        beside a hand-off) after NCCL's ``unjoined`` op; neither in a capture (a graph may
        not wait for work outside it; torch's capture begins after a synchronize)."""
        if not self.graph:
            if joins and self.unjoined is not None:
                self.follow = self.unjoined()
                self.unjoined = None  # (only once joined: a join that raised is tried again)
            if self.follow is not None:
                runtime.stream_wait_event(stream, self.follow)
                self.follow = None
        self.op_id, self.ctx, self.stream, self.dtype, self.reduce_op = op_id, ctx, stream, dtype, reduce_op
        self.fprint = fprint

    # -- what the algorithms call -------------------------------------------------------------
    def round(self) -> None:
        if not self.graph:
            self.rounds += 1

    def slot_bytes(self) -> int:
        """Bytes of one slot of this op's rounds (a graph slot, captured)."""
        return self.layout.graph if self.graph else self.layout.slot

    def slot(self, r: int) -> int:
        return self.bases[r] + self.layout.slot_at(self.rounds & 1)

    def barrier(self) -> None:
        t = time.perf_counter()
        self.epoch += 1
        self.k.barrier(self.controls, self.rank, self.world, self.host, self.op_id, self.timeout_ns,
                       fprint=self.fprint, epoch=self.epoch, stream=self.stream)
        if recorder.current is not None:
            recorder.transfer("sync", self.ctx, "cuda", t, algorithm="barrier")

    def copy(self, dst: int, src: int, nbytes: int, peer: int = -1) -> None:
        if nbytes <= 0 or dst == src:  # (an all_gather whose input is its own block of the output)
            return
        t = time.perf_counter()
        self.memcpy(dst, src, nbytes, self.stream)
        if recorder.current is not None:
            recorder.transfer("copy", self.ctx, "cuda", t, nbytes, self._global(peer))

    def reduce(self, out: int, offset: int, n: int) -> None:
        if n <= 0:
            return
        t = time.perf_counter()
        self.k.reduce(self.rows[self.rounds & 1], offset, out, n, self.world, self.reduce_op, self.dtype,
                      stream=self.stream)
        if recorder.current is not None:
            recorder.transfer("reduce", self.ctx, "cuda", t, n * self.ws.itemsize(self.dtype))

    def all_reduce_fused(self, kind: str, inp: int, out: int, n: int, per_thread: int = 8):
        """One launch: ``out[:n]`` = op over ranks of ``inp[:n]`` through this round's
        slots (``kind``: one of chorus.cuda.launchers.FUSED_KINDS), with its own barrier(s)
        at the group's next epoch(s); a two-shot kernel's threads move ``per_thread``
        elements a step (CHORUS_CUDA_TWO_SHOT_PER_THREAD, when set, instead).  Returns the
        launch's Shot (chorus.cuda.launchers), for ``shot`` to repeat, where the kernels
        make one (else None)."""
        if n <= 0:
            return None
        t = time.perf_counter()
        if kind != "one_shot" and self.two_shot_per_thread:
            per_thread = self.two_shot_per_thread
        if self.graph:  # slot and epochs from the device's counts
            self.k.all_reduce_fused(
                kind, inp, out, n, self.controls_addr, self.layout.graph_slot_at(0), self.rank, self.world,
                self.host, self.op_id, self.fprint, 0, self.timeout_ns, self.reduce_op, self.dtype,
                stream=self.stream, warps=self.fused[0], blocks=self.fused[1], per_thread=per_thread,
                graph_slot=self.layout.graph)
        else:
            self.epoch += self.k.all_reduce_fused(
                kind, inp, out, n, self.controls_addr, self.layout.slot_at(self.rounds & 1), self.rank, self.world,
                self.host, self.op_id, self.fprint, self.epoch + 1, self.timeout_ns, self.reduce_op, self.dtype,
                stream=self.stream, warps=self.fused[0], blocks=self.fused[1], per_thread=per_thread)
        if recorder.current is not None:
            recorder.transfer("reduce", self.ctx, "cuda", t, n * self.ws.itemsize(self.dtype), algorithm=kind)
        make = None if self.graph else getattr(self.k, "fused_shot", None)
        return None if make is None else make(
            kind, n, self.controls_addr, self.rank, self.world, self.host, self.fprint, self.timeout_ns,
            self.reduce_op, self.dtype, warps=self.fused[0], blocks=self.fused[1], per_thread=per_thread)

    def shot(self, shot, inp: int, out: int | None = None) -> bool:
        """The op, from ``inp`` into ``out`` (None: in place), as one launch of ``shot``
        (a Shot that all_reduce_fused or rows_fused of these lanes returned) through the
        next round's slot, as those would launch it; or, where the addresses were seen
        before, a replay of its CUDA graph (chorus.cuda.replays).  False, with nothing
        enqueued, where it cannot (captured in a CUDA graph; a value outside the shot's
        kernel): the algorithm's path then."""
        if self.graph:
            return False
        t = time.perf_counter() if recorder.current is not None else 0.0
        if out is None:
            out = inp
        rounds = self.rounds + 1
        slot_off = self.slot_offs[rounds & 1]
        replays = shot.replays
        if replays is None and self.replay:
            replays = shot.replays = self._replays(shot)
        used = replays(inp, out, rounds & 1, slot_off, self.stream) if replays else 0
        if used:
            self.names.replayed(self.epoch + 1, self.op_id)
        else:
            used = shot(inp, out, slot_off, self.op_id, self.epoch + 1, self.stream)
            if not used:
                return False
        self.rounds = rounds
        self.epoch += used
        if t:
            gather = shot.kind == "all_gather"
            recorder.transfer("copy" if gather else "reduce", self.ctx, "cuda", t, shot.n * self.ws.itemsize(self.dtype),
                              algorithm="fused" if shot.kind in ("all_gather", "reduce_scatter") else shot.kind)
        return True

    def replay_kept(self, plan, inp: int, out: int, stream: int, seq: int, fprint: int, name: str) -> bool:
        """The steady state of a repeated op, in the fewest steps: where ``plan``'s Shot
        keeps a graph for these addresses and the next round's parity, and no other work
        is to be followed first (``follow``, ``unjoined``), that graph launched on
        ``stream`` as op ``seq`` of collective ``name`` (noted in ``names``) and True;
        else False with nothing enqueued (begin() and repeat() then).  Not captured,
        no recorder listener (the caller's lane checked both); under the group's lock."""
        if self.follow is not None or self.unjoined is not None:
            return False
        shot = self.shots.get(plan)
        replays = None if shot is None else shot.replays
        if not replays:
            return False
        rounds = self.rounds + 1
        exe = replays.kept.get((inp, out, rounds & 1))  # (Replays.__call__ would test more: first sight, alignment)
        if not exe:
            return False
        if stream != self.stream_arg[0]:
            self.stream_arg = (stream, ctypes.c_void_p(stream))
        if replays.graphs.launch(exe, self.stream_arg[1]):
            replays.refused()  # (replays off from then on: the caller's begin() and repeat() launch)
            return False
        self.rounds = rounds
        epoch = self.epoch + 1
        self.epoch += shot.barriers
        self.names.add_replayed(epoch, seq, fprint, name)
        return True

    def repeat(self, plan, inp: int, out: int, first) -> None:
        """The op of ``plan`` (a lane plan: chorus.cuda.plans) from ``inp`` into ``out``:
        a launch (or replay) of the Shot its last call left, else ``first()`` (the
        algorithm's launches), whose Shot, if it returns one, is kept for the next call
        (the kept one stays where it is the same launch: an unaligned address stepped
        aside; one replaced has its graphs destroyed).  After begin(), under the group's
        lock."""
        kept = self.shots.get(plan)
        if kept is not None and self.shot(kept, inp, out):
            return
        shot = first()
        if shot is None or (kept is not None and kept.key == shot.key):
            return
        if kept is not None:
            if kept.replays:
                kept.replays.close()
        elif len(self.shots) >= SHOTS:
            self.forget_shots()
        self.shots[plan] = shot

    def rows_once(self, kind: str, inp: int, out: int, m: int, stride: int, item: int):
        """A lane's all_gather_into_tensor or reduce_scatter_tensor (``kind``) in one round
        (``m`` elements a rank): rows_fused's launch, and its Shot (or None)."""
        self.round()
        return self.rows_fused(kind, inp, out, m, stride, m, item, keep=True)

    def _replays(self, shot):
        """A Replays of ``shot`` (False where this process's driver cannot capture)."""
        from chorus.cuda import replays

        if self.graphs is None:
            self.graphs = replays.driver()
            if self.graphs is None or self.names is None:
                self.replay = False
                return False
            self.capture_stream = self.graphs.new_stream()
        return replays.Replays(shot, self.graphs, self.capture_stream)

    def forget_shots(self) -> None:
        """Drop the kept Shots (a full cache) and destroy their replay graphs."""
        for shot in self.shots.values():
            if shot.replays:
                shot.replays.close()
        self.shots.clear()

    def close(self) -> None:
        """Destroy the replay graphs (the workspace they point into is about to go) and
        the stream they were captured on."""
        self.forget_shots()
        if self.capture_stream is not None:
            self.graphs.destroy_stream(self.capture_stream)
            self.capture_stream = None

    def rows_fused(self, kind: str, inp: int, out: int, m: int, stride: int, big_n: int, item: int,
                   keep: bool = False):
        """One launch: a round of the fused ``kind`` ("all_gather" or "reduce_scatter":
        chorus.cuda.gather) through this round's slots, with its barrier at the group's
        next epoch.  ``keep``: returns the launch's Shot, for ``shot`` to repeat, where
        the kernels make one (else None)."""
        if m <= 0:
            return None
        t = time.perf_counter()
        self.epoch += self.k.rows_fused(
            kind, inp, out, m, stride, big_n, self.controls_addr, self.layout.slot_at(self.rounds & 1), self.rank,
            self.world, self.host, self.op_id, self.fprint, self.epoch + 1, self.timeout_ns, self.reduce_op,
            self.dtype, item, stream=self.stream, warps=self.fused[0], blocks=self.fused[1])
        if recorder.current is not None:
            recorder.transfer("copy" if kind == "all_gather" else "reduce", self.ctx, "cuda", t, m * item,
                              algorithm="fused")
        make = getattr(self.k, "rows_shot", None) if keep else None
        return None if make is None else make(
            kind, m, stride, big_n, self.controls_addr, self.rank, self.world, self.host, self.fprint, self.timeout_ns,
            self.reduce_op, self.dtype, item, warps=self.fused[0], blocks=self.fused[1])

    def send_chunk(self, peer: int, src: int, nbytes: int, tag: int, total: int) -> None:
        """Chunk s of my channel to ``peer`` (parity s % 2): wait until ``peer`` took
        chunk s - 2 out of that parity, copy in, post READY = s (with the header)."""
        t = time.perf_counter()
        s = self.sent[peer] = self.sent[peer] + 1
        me = self.bases[self.rank]
        if s > 2:
            self.k.wait(me + L.ACK + 8 * peer, s - 2, peer, self.host, self.op_id, L.WAIT_ACK, self.timeout_ns,
                        mirror_addr=me + L.BROKEN)
        hdr = me + self.layout.channel_at(peer, s & 1)
        if nbytes > 0:
            self.memcpy(hdr + L.CHANNEL_HEADER, src, nbytes, self.stream)
        self.k.post(self.bases[peer] + L.READY + 8 * self.rank, s, self.host, hdr, tag, total,
                    mirror_addr=me + L.BROKEN)
        if recorder.current is not None:
            recorder.transfer("copy", self.ctx, "cuda", t, nbytes, self._global(peer), direction="send")

    def recv_chunk(self, peer: int, dst: int, nbytes: int, tag: int, total: int) -> None:
        """Chunk s from ``peer``'s channel to me: wait for READY >= s (checking the
        header), copy out, post ACK = s into ``peer``'s workspace."""
        t = time.perf_counter()
        s = self.received[peer] = self.received[peer] + 1
        hdr = self.bases[peer] + self.layout.channel_at(self.rank, s & 1)
        me = self.bases[self.rank]
        self.k.wait(me + L.READY + 8 * peer, s, peer, self.host, self.op_id, L.WAIT_READY, self.timeout_ns, hdr, tag,
                    total, mirror_addr=me + L.BROKEN)
        if nbytes > 0:
            self.memcpy(dst, hdr + L.CHANNEL_HEADER, nbytes, self.stream)
        self.k.post(self.bases[peer] + L.ACK + 8 * self.rank, s, self.host, mirror_addr=me + L.BROKEN)
        if recorder.current is not None:
            recorder.transfer("copy", self.ctx, "cuda", t, nbytes, self._global(peer), direction="recv")

    def _global(self, peer: int) -> int:
        return self.ws.members[peer] if peer >= 0 else -1
