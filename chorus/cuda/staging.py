"""Staging: run a CUDA call through page-locked host memory and chorus's CPU components.

What a group uses when its members cannot map each other's memory (another host, no
peer access, a failed check, ``CHORUS_CUDA_STAGING=1``) and for calls the kernels do not
cover (complex reductions).  Every collective and dtype that the CPU path supports works;
float8 reductions go through float32 (copied up on the GPU, rounded back once).

    caller's stream:  [before] D2H (blocking: the stream's earlier work is done)
    CPU:              the same collective over host arrays (chorus.components.select)
    caller's stream:  H2D (async from pinned memory)  [after]

The CPU op takes the CUDA call's place in the group's issue order (its hooks run in
order on the group's worker when ops are queued), so ordering is chorus's usual.
"""

from __future__ import annotations

import threading

from chorus.reductions import ReduceOp, combiner
from chorus.selection import valid_names
from chorus.work import HandleWork

#: torch dtype name -> (dtype of the pinned copy, chorus dtype name of the CPU op)
_AS = {"bfloat16": ("uint16", "bfloat16"), "float8_e4m3fn": ("uint8", "uint8"),
       "float8_e5m2": ("uint8", "uint8")}
_WIDE = frozenset({"float8_e4m3fn", "float8_e5m2"})  # reduced in float32
_INTO = {"data", "input"}  # buffers copied to the host before the op
_BACK = {"data", "output"}  # buffers copied back after it


def is_cuda(call) -> bool:
    """Whether chorus Call ``call`` moves CUDA tensors."""
    device = getattr(call, "device", None)
    if device is not None:
        return device == "cuda"
    return any(getattr(t, "is_cuda", False) for t in call.buffers.values())


def torch_dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


#: chorus.cuda's own algorithm names (chorus.cuda.component): a staged call named by one
#: the CPU path does not know runs the CPU path's own choice
CUDA_ALGORITHMS = frozenset({"one_shot", "two_shot", "two_shot_push", "two_shot_stores", "copy_reduce", "fused",
                             "channels", "nccl", "staging"})


def on_stream(fn, stream):
    """``fn`` made to run on ``stream`` (and its device) from any thread (no stream: ``fn``)."""
    if fn is None or stream is None:
        return fn
    import torch

    home = threading.get_ident()

    def run(*args):
        if threading.get_ident() == home:
            return fn(*args)
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            return fn(*args)

    return run


def _stream_of(t):
    import torch

    return torch.cuda.current_stream(t.device) if t.is_cuda else None


class Staged:
    """Pinned host copies of a call's tensors, and the hooks that move them."""

    def __init__(self, buffers: dict, reducing: bool):
        import torch

        self.tensors = {k: t for k, t in buffers.items() if isinstance(t, torch.Tensor)}
        first = next(iter(self.tensors.values()), None)
        self.dtype = torch_dtype_name(first) if first is not None else "uint8"
        self.wide = reducing and self.dtype in _WIDE
        host_dtype, self.cpu_dtype = ("float32", "float32") if self.wide else _AS.get(self.dtype, (self.dtype,) * 2)
        self.host = {k: torch.empty(t.numel(), dtype=torch.float32 if self.wide else t.dtype,
                                    pin_memory=t.is_cuda) for k, t in self.tensors.items()}
        self.arrays = {k: h.view(getattr(torch, host_dtype)).numpy() for k, h in self.host.items()}

    def to_host(self, names=_INTO) -> None:
        for k, t in self.tensors.items():
            if k in names:
                self.host[k].copy_(t.float() if self.wide else t)  # blocking: the stream's work is done

    def to_device(self, names=_BACK) -> None:
        for k, t in self.tensors.items():
            if k in names:
                h = self.host[k]
                t.copy_(h.to(t.device, non_blocking=True) if self.wide else h, non_blocking=True)


def start(call, algorithm: str, run_cpu):
    """Run CUDA ``call`` staged; ``run_cpu(cpu_call)`` runs a call over host arrays
    (chorus.components.select.start).  Returns what it returns."""
    staged = Staged(call.buffers, bool(call.reduce_op))
    first = next(iter(staged.tensors.values()), None)
    stream = _stream_of(first) if first is not None else None
    op = {"AVG": "SUM", "PREMUL_SUM": "SUM"}.get(call.reduce_op, call.reduce_op)
    back = set(_BACK)
    if call.name == "reduce" and call.group.rank() != call.root:
        back.discard("data")  # non-roots keep their input

    def before():
        if call.before is not None:
            call.before()
        staged.to_host()

    def after():
        staged.to_device(back)
        if call.after is not None:
            call.after()

    buffers = dict(call.buffers)
    buffers.update(staged.arrays)
    fields = dict(buffers=buffers, dtype=staged.cpu_dtype, reduce_op=op,
                  combine=combiner(getattr(ReduceOp, op), staged.cpu_dtype) if op else None,
                  before=on_stream(before, stream), after=on_stream(after, stream))
    if call.algorithm in CUDA_ALGORITHMS and call.algorithm not in valid_names(call.name):
        fields["algorithm"] = None  # (a name both paths know, "two_shot", stays)
    if "device" in call._fields:
        fields["device"] = "cpu"
    return run_cpu(call._replace(**fields))


def p2p(pg, kind: str, tensor, peer: int, tag: int, async_op: bool):
    """A staged send or receive of ``tensor`` with group rank ``peer`` over the group's
    transport (matching as chorus's CPU point-to-point: per pair and tag, in order)."""
    from chorus.wire.dtypes import dtype_code

    staged = Staged({"data": tensor}, False)
    array = staged.arrays["data"]
    view = memoryview(array).cast("B")
    code = dtype_code(staged.cpu_dtype)
    describe = lambda: f"{kind} {'to' if kind == 'send' else 'from'} rank {pg.members[peer]} (tag {tag}, staged)"  # noqa: E731
    if kind == "send":
        staged.to_host()
        handle = pg.post_send(view, peer, tag, code, not async_op)
        finish = None
    else:
        handle = pg.post_recv(view, peer, tag, code)
        finish = on_stream(staged.to_device, _stream_of(tensor))
    work = HandleWork(pg.transport, [handle], pg.deadline(), describe, finish=finish, result=[tensor])
    if async_op:
        return work
    work.wait()
    return None
