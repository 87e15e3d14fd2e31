"""``ChorusProcessGroup``: torch.distributed's process-group interface, served by chorus.

torch cannot take a Python subclass of its C++ ``Backend``; it can take a Python subclass
of ``ProcessGroup`` (its C++ trampoline forwards DDP's, FSDP's and the functional
collectives' calls to the Python methods).  So the backend *is* the process group:
``register_backend("chorus", ...)``'s creator returns one of these, and every method
below turns torch's (tensor lists, options) call into the matching chorus collective on
the group's chorus ``ProcessGroup`` (ranks in torch's arguments are group ranks)::

    torch                                   chorus
    allreduce([t], opts)                    all_reduce(t, op)
    allreduce_coalesced(ts, opts)           one all_reduce over the ts flattened
    allgather([[o0..oW]], [t], opts)        all_gather([o0..oW], t)
    all_gather_single / _allgather_base     all_gather_into_tensor
    allgather_into_tensor_coalesced         all_gather_into_tensor per pair
    reduce_scatter([o], [[i0..iW]], opts)   reduce_scatter(o, [i0..iW], op)
    reduce_scatter_single / _base           reduce_scatter_tensor
    reduce_scatter_tensor_coalesced         reduce_scatter_tensor per pair
    alltoall / all_to_all_single            all_to_all / all_to_all_single (uneven splits)
    broadcast / reduce / gather / scatter   the same, root = opts.rootRank
    send / recv / recv_anysource            isend / irecv (tag kept)
    barrier                                 barrier

``opts.asyncOp`` is False when the caller waits at once (``async_op=False``): the op then
runs in the calling thread with no hand-off, and chorus's own exception
(``PeerLostError``, ``CollectiveMismatchError``, ...) propagates unchanged.  Otherwise
(DDP's buckets, ``async_op=True``, functional collectives) it runs on the group's worker
thread in issue order and the returned :class:`~chorus.torch.work.TorchWork` delivers
the result or the error.

``monitored_barrier`` is implemented, but torch 2.13 only routes it to gloo groups.

Errors leave as torch's ``DistBackendError`` / ``DistNetworkError`` / ``DistStoreError``
(still chorus's classes too: chorus.torch.errors).  While torch's profiler records, each op
adds a ``"chorus:<op>"`` event (chorus.torch.profiling).  A sparse COO tensor is all-reduced
(SUM) as gloo does it (chorus.torch.sparse); the other collectives refuse sparse tensors
before anything is sent.
"""

from __future__ import annotations

import functools
from datetime import timedelta

import torch
import torch.distributed as dist

from chorus.api import collectives, exchange, gathering, p2p
from chorus.errors import InvalidArgumentError, InvalidTensorError
from chorus.reductions import ReduceOp, make_premul_sum
from chorus.torch.errors import as_torch_error
from chorus.torch.fabric import Membership, entered
from chorus.torch.profiling import Recording, profiling
from chorus.torch.sharing import Sharing, unmarked_view
from chorus.torch.sparse import all_reduce_sparse
from chorus.torch.work import TorchWork

BACKEND_NAME = "chorus"


_PLAIN_OPS: dict = {}  # torch RedOpType -> chorus ReduceOp (reading an enum's .name costs ~5 us)


def chorus_op(op):
    """chorus's ReduceOp for torch's ``ReduceOp`` / ``ReduceOp.RedOpType`` (PREMUL_SUM keeps its factor)."""
    kind = getattr(op, "op", op)
    plain = _PLAIN_OPS.get(kind)
    if plain is not None:
        return plain
    name = kind.name
    if name == "PREMUL_SUM":
        factor = op.factor
        return make_premul_sum(float(factor.item() if isinstance(factor, torch.Tensor) else factor))
    plain = _PLAIN_OPS[kind] = getattr(ReduceOp, name)
    return plain


def _async(opts) -> bool:
    return getattr(opts, "asyncOp", True) if opts is not None else True


def _check_cpu(op: str, tensors) -> None:
    """CPU and CUDA tensors (CUDA: chorus's CUDA component, chorus.cuda); nothing else."""
    for t in tensors:
        if t.device.type not in ("cpu", "cuda"):
            raise InvalidTensorError(
                f"chorus.torch {op}: got a tensor on {t.device}; the \"chorus\" backend moves CPU "
                "and CUDA tensors: move it with .cpu() or .cuda()")


def _root(opts, op: str) -> int:
    if opts is None:
        raise InvalidArgumentError(f"chorus.torch {op}: options with rootRank are required")
    return int(opts.rootRank)


class ChorusProcessGroup(dist.ProcessGroup):
    """A torch process group whose collectives run on chorus (see the module docstring)."""

    def __init__(self, membership: Membership, rank: int, size: int, group_name: str):
        super().__init__(rank, size)
        self._membership = membership
        self._pg = membership.pg
        self._world = membership.world
        self._rank = rank
        self._size = size
        self._group_name = group_name
        self._group_desc = "undefined"
        self._sharing = Sharing(self._pg)

    def __repr__(self) -> str:
        return f"ChorusProcessGroup(name={self._group_name!r}, rank={self._rank}, size={self._size})"

    # -- identity (torch asks the trampoline for these) ----------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def _name_in_torch(self) -> str:
        """The backend name torch created this group under (``get_backend(group)``): "chorus",
        unless the group was asked for by another name and given to chorus.  Profiler events
        are named after it, as torch's own backends name theirs.  (``getBackendName`` stays
        "chorus": torch's C++ looks up its own backend objects by that name.)"""
        try:
            name = str(dist.get_backend(self))
        except (ValueError, RuntimeError):  # not (yet) in torch's table of groups
            return BACKEND_NAME
        return name if name.isidentifier() else BACKEND_NAME  # "cpu:chorus,cuda:nccl": chorus

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    @property
    def chorus_group(self):
        """The chorus ``ProcessGroup`` this torch group runs on."""
        return self._pg

    def shutdown(self) -> None:
        """torch's destroy_process_group: leave the chorus group (BYE for the world)."""
        self._membership.close()

    def abort(self) -> None:
        self._membership.close()

    # -- issuing -------------------------------------------------------------------------
    def _issue(self, op: str, opts, tensors, calls, result, finish=None, inputs=None,
               recording: Recording | None = None) -> TorchWork:
        """Run ``calls`` (each ``call(async_op)`` issues one chorus op) in issue order.

        ``op`` is torch's name for the op (its profiler events' names); ``inputs`` are the
        tensors the event shows (``tensors``, inputs and outputs, unless given);
        ``recording``: the op's profiler event, where already begun."""
        _check_cpu(op, tensors)
        async_op = _async(opts)
        works, recording = self._start(op, tensors if inputs is None else inputs, calls, async_op, recording)
        work = TorchWork(works if async_op else [], result, finish, recording=recording)
        if async_op:
            self._sharing.issued(tensors, work)  # their storages are not moved while it runs
        return work

    def _start(self, op: str, inputs, calls, async_op: bool,
               recording: Recording | None = None) -> tuple[list, Recording | None]:
        """``call(async_op)`` for each call, in this group's chorus World, under the op's
        profiler event while torch's profiler records (``recording``, where begun already);
        chorus's errors leave as torch's."""
        if recording is None and profiling():
            recording = self._record(op, inputs)
        try:
            with entered(self._world):
                return [call(async_op) for call in calls], recording
        except BaseException as exc:
            if recording is not None:
                recording.close()
            as_torch_error(exc)
            raise

    def _record(self, op: str, inputs) -> Recording:
        """The profiler event of one op, as gloo's: complex tensors shown as real views."""
        shown = [torch.view_as_real(t) if t.is_complex() else t for t in inputs]
        return Recording(f"{self._name_in_torch()}:{op}", shown)

    # -- reductions ----------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        """Large tensors all-reduced again and again (DDP's buckets) move into shared memory
        (chorus.torch.sharing) before the view of their memory is taken."""
        op = chorus_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        recording, general = None, _all_reduce
        if len(tensors) == 1 and tensors[0].is_cuda and not tensors[0].is_sparse:
            recording = self._record("all_reduce", tensors) if profiling() else None
            work = self._cuda_all_reduce_now(tensors[0], op, _async(opts), recording)
            if work is not None:
                return work
            general = _all_reduce_general  # (the lane was asked: once is enough)
        if tensors and tensors[0].is_sparse:
            calls = [functools.partial(_all_reduce_sparse, t, op, self._pg) for t in tensors]
            return self._issue("sparse_all_reduce", opts, tensors, calls, list(tensors))
        for t in tensors:
            self._sharing.offer(t)
        calls = [functools.partial(general, _array(t, self._sharing.share_bytes), op, self._pg) for t in tensors]
        return self._issue("all_reduce", opts, tensors, calls, list(tensors), recording=recording)

    def _cuda_all_reduce_now(self, t, op, async_op: bool, recording: Recording | None) -> TorchWork | None:
        """``t`` all-reduced by the group's CUDA component's lane, called straight (no
        per-call closures or chorus API in between: DDP's bucket handed to NCCL starts tens
        of microseconds sooner); None where the lane steps aside (the general way then,
        under the same profiler event ``recording``)."""
        gpu = self._pg.device_components.get("cuda")
        if gpu is None:
            return None
        try:
            with entered(self._world):
                done = gpu.all_reduce_now(t, op, async_op)
        except BaseException as exc:
            if recording is not None:
                recording.close()
            as_torch_error(exc)
            raise
        if not done:
            return None
        return TorchWork([done] if async_op else [], [t], recording=recording)

    def allreduce_coalesced(self, tensors, opts=None):
        """One all_reduce over the tensors flattened (per dtype), copied back at the end."""
        op = chorus_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        flats, finishers = [], []
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            flats.append(flat)
            finishers.append(functools.partial(_unflatten, flat, same))
        calls = [functools.partial(_all_reduce, flat, op, self._pg) for flat in flats]
        return self._issue("all_reduce", opts, tensors, calls, list(tensors),
                           finish=lambda: [f() for f in finishers])

    def reduce(self, tensors, opts=None):
        root, op = _root(opts, "reduce"), chorus_op(opts.reduceOp)
        calls = [lambda a, t=t: collectives.reduce(t, op=op, group=self._pg, async_op=a, group_dst=root)
                 for t in tensors]
        return self._issue("reduce", opts, tensors, calls, list(tensors))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = chorus_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        calls = [lambda a, o=o, ins=ins: exchange.reduce_scatter(o, list(ins), op=op, group=self._pg, async_op=a)
                 for o, ins in zip(output_tensors, input_tensors, strict=True)]
        flat_in = [t for ins in input_tensors for t in ins]
        return self._issue("reduce_scatter", opts, [*output_tensors, *flat_in], calls, list(output_tensors),
                           inputs=flat_in)

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = chorus_op(opts.reduceOp) if opts is not None else ReduceOp.SUM
        calls = [lambda a, o=o, i=i: exchange.reduce_scatter_tensor(o, i, op=op, group=self._pg, async_op=a)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._issue("reduce_scatter_tensor", opts, [*outputs, *inputs], calls, list(outputs), inputs=inputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- gathering and scattering -------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        calls = [lambda a, outs=outs, t=t: gathering.all_gather(list(outs), t, group=self._pg, async_op=a)
                 for outs, t in zip(output_tensors, input_tensors, strict=True)]
        flat_out = [o for outs in output_tensors for o in outs]
        return self._issue("all_gather", opts, [*flat_out, *input_tensors], calls, list(output_tensors),
                           inputs=input_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``output_lists[r][j]`` receives rank r's ``input_list[j]``."""
        calls = [lambda a, j=j, t=t: gathering.all_gather([outs[j] for outs in output_lists], t, group=self._pg,
                                                         async_op=a)
                 for j, t in enumerate(input_list)]
        flat_out = [o for outs in output_lists for o in outs]
        return self._issue("all_gather", opts, [*flat_out, *input_list], calls, list(output_lists),
                           inputs=input_list)

    def all_gather_single(self, output, input, opts=None):
        return self.all_gather_single_coalesced([output], [input], opts)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        calls = [lambda a, o=o, i=i: gathering.all_gather_into_tensor(o, i, group=self._pg, async_op=a)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._issue("all_gather_into_tensor", opts, [*outputs, *inputs], calls, list(outputs), inputs=inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors, input_tensors, opts=None):
        root = _root(opts, "gather")
        outs = list(output_tensors[0]) if output_tensors else None
        t = input_tensors[0]
        call = functools.partial(_gather, t, outs, root, self._pg)
        return self._issue("gather", opts, [t, *(outs or [])], [call], [outs or []], inputs=[t])

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = _root(opts, "scatter")
        ins = list(input_tensors[0]) if input_tensors else None
        t = output_tensors[0]
        call = functools.partial(_scatter, t, ins, root, self._pg)
        return self._issue("scatter", opts, [t, *(ins or [])], [call], [t], inputs=ins or [])

    def broadcast(self, tensors, opts=None):
        root = _root(opts, "broadcast")
        calls = [functools.partial(_broadcast, _array(t, self._sharing.share_bytes), root, self._pg) for t in tensors]
        return self._issue("broadcast", opts, tensors, calls, list(tensors))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        call = functools.partial(_all_to_all, list(output_tensors), list(input_tensors), self._pg)
        return self._issue("all_to_all", opts, [*output_tensors, *input_tensors], [call], list(output_tensors),
                           inputs=input_tensors)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        out_splits = list(output_split_sizes) if output_split_sizes else None
        in_splits = list(input_split_sizes) if input_split_sizes else None
        self._sharing.offer(input, "all_to_all")  # an input sent again and again moves into shared memory
        source = _array(input, self._sharing.share_bytes)

        def call(a):
            return exchange.all_to_all_single(output, source, out_splits, in_splits, group=self._pg, async_op=a)

        return self._issue("all_to_all", opts, [output, input], [call], [output], inputs=[input])

    alltoall_base = all_to_all_single

    # -- synchronisation -------------------------------------------------------------------
    def barrier(self, opts=None):
        return self._issue("barrier", opts, [], [functools.partial(_barrier, self._pg)], [])

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False) -> None:
        limit = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        try:
            with entered(self._world):
                collectives.monitored_barrier(self._pg, timeout=limit, wait_all_ranks=wait_all_ranks)
        except BaseException as exc:
            as_torch_error(exc)
            raise

    # -- point-to-point ------------------------------------------------------------------------
    def send(self, tensors, dstRank: int, tag: int = 0):  # noqa: N803 - torch's names
        return self._point("send", tensors, [functools.partial(_isend, self._pg, tag, dstRank, t) for t in tensors])

    def recv(self, tensors, srcRank: int, tag: int = 0):  # noqa: N803
        return self._point("recv", tensors, [functools.partial(_irecv, self._pg, tag, srcRank, t) for t in tensors],
                           lambda works: srcRank)

    def recv_anysource(self, tensors, tag: int = 0):
        pg = self._pg
        return self._point("recvAnySource", tensors[:1], [functools.partial(_irecv, pg, tag, None, tensors[0])],
                           lambda works: pg.group_rank(works[0].source_rank()), result=list(tensors))

    def _point(self, op: str, tensors, calls, source_rank=None, result=None) -> TorchWork:
        """``calls`` (an isend or irecv of each tensor) as one torch Work."""
        _check_cpu(op, tensors)
        works, recording = self._start(op, tensors, calls, True)
        rank_of = None if source_rank is None else functools.partial(source_rank, works)
        return TorchWork(works, list(tensors) if result is None else result, source_rank=rank_of,
                         recording=recording)


# Module-level helpers (partial() of these costs less than a closure per call).
_NO_NUMPY = frozenset((torch.bfloat16,))


def _array(t, share_bytes: int):
    """What to hand chorus for tensor ``t``: a numpy view of its memory when ``t`` is a plain
    contiguous CPU tensor (DDP's buckets, a loss), else ``t`` itself (chorus converts it,
    copying if non-contiguous).  The view skips ``t.detach()`` — a torch call, which lets
    go of the GIL: in DDP's autograd hook, with chorus's worker busy on the previous
    bucket, each such call is a GIL round trip — and it lets a small synchronous
    all_reduce take chorus's latency path (numpy arrays only).  For a tensor large enough
    to move into shared memory (``share_bytes``, chorus.torch.sharing) the view is made without
    ``t.numpy()``, which would mark the storage as aliased by numpy for good."""
    if t.requires_grad or t.dtype in _NO_NUMPY or not t.is_cpu or not t.is_contiguous():
        return t
    try:
        if t.nbytes >= share_bytes and not t.is_conj() and not t.is_neg() and type(t) is torch.Tensor:
            return unmarked_view(t)
        return t.numpy()
    except (RuntimeError, TypeError):  # conjugate/negative views, tensor subclasses: chorus's own path
        return t


def _all_reduce(t, op, pg, async_op):
    return collectives.all_reduce(t, op=op, group=pg, async_op=async_op)


def _all_reduce_general(t, op, pg, async_op):
    return collectives.all_reduce_general(t, op=op, group=pg, async_op=async_op)


def _all_reduce_sparse(t, op, pg, async_op):
    """Runs at once, also for async_op (three all_gathers in issue order): no Work."""
    all_reduce_sparse(t, op, pg)


def _isend(pg, tag, dst, t, async_op):
    return p2p.isend(t, group=pg, tag=tag, group_dst=dst)


def _irecv(pg, tag, src, t, async_op):
    return p2p.irecv(t, group=pg, tag=tag, group_src=src)


def _broadcast(t, root, pg, async_op):
    return collectives.broadcast(t, group=pg, async_op=async_op, group_src=root)


def _unflatten(flat, tensors) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.detach().copy_(flat[offset: offset + n].view_as(t))
        offset += n


def _gather(t, outs, root, pg, async_op):
    return gathering.gather(t, outs, group=pg, async_op=async_op, group_dst=root)


def _scatter(t, ins, root, pg, async_op):
    return gathering.scatter(t, ins, group=pg, async_op=async_op, group_src=root)


def _all_to_all(outs, ins, pg, async_op):
    return exchange.all_to_all(outs, ins, group=pg, async_op=async_op)


def _barrier(pg, async_op):
    return collectives.barrier(group=pg, async_op=async_op)
