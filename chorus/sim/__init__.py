"""Run any schedule for W virtual ranks in one process, check it, and predict its time.

``simulate`` executes every rank's schedule with the runtime's semantics: a step posts
its sends eagerly (the data is copied when the step starts; the sender never waits),
does its copies, and ends once each of its receives has matched a message.  A receive
from ``peer`` with tag ``t`` takes the earliest unmatched message from ``peer`` to this
rank with tag ``t`` (FIFO per (src, dst, tag)); several receives with the same key in
one step match in the order they are listed.

Every step is checked first: known buffers, regions in range, peers in the group and
not the rank itself (a Copy does that), and no overlap between what a step writes (Recv
and Copy destinations) and anything else it reads or writes.  That is stricter than
"never send what you write" and keeps every reduction in one fixed order.  Output and
scratch buffers start filled with junk, so a schedule that forgets to write shows.

    >>> import numpy as np
    >>> out = simulate("all_reduce", "ring", 3, [{"data": np.arange(4) * r} for r in range(3)])
    >>> out[2]["data"]
    array([0, 3, 6, 9])

``predict`` costs a schedule with the alpha-beta(-gamma) model instead of running it; given
a :class:`GpuTopology` (chorus.sim.gpu) instead of a world size, it predicts the ring, tree
and hierarchical GPU algorithms on hosts of GPUs joined by NVLink and NICs.
"""

from __future__ import annotations

import functools
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

import numpy as np

from chorus.errors import InvalidArgumentError
from chorus.schedules.base import Copy, Recv, Region, Schedule, Send, Step
from chorus.schedules.chunks import offsets, split
from chorus.schedules.registry import algorithm as find_algorithm
from chorus.sim.gpu import GpuTopology, Prediction, estimate

Buffers = dict[str, np.ndarray]
__all__ = ["OPS", "ROOTED", "GpuTopology", "Prediction", "ScheduleError", "check",
           "element_count", "estimate", "execute", "predict", "reference", "simulate"]
OPS: dict[str, Callable] = {
    "sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}
ROOTED = ("broadcast", "reduce", "gather", "scatter")


class ScheduleError(ValueError):
    """A schedule breaks a rule or cannot finish (deadlock, unmatched message, ...)."""


# -- laying out each rank's buffers -----------------------------------------------------


def _junk(n: int, dtype: np.dtype) -> np.ndarray:
    kind = np.dtype(dtype).kind
    fill = np.nan if kind in "fc" else True if kind == "b" else np.iinfo(dtype).max // 3
    return np.full(n, fill, dtype=dtype)


def _layout(collective: str, world: int, inputs: list[Buffers], kwargs: dict):
    """Per rank: (the schedule function's keyword arguments, the rank's buffers)."""
    if len(inputs) != world:
        raise ValueError(f"need one input dict per rank: got {len(inputs)} for world {world}")
    bufs = [{name: np.array(arr, copy=True).ravel() for name, arr in inp.items()}
            for inp in inputs]
    root = kwargs.get("root", 0)
    dtype = next(iter(bufs[root].values())).dtype if bufs[root] else np.dtype(np.int64)
    kws = [dict(kwargs, root=root) if collective in ROOTED else dict(kwargs)
           for _ in range(world)]
    for r, (kw, b) in enumerate(zip(kws, bufs, strict=True)):
        if collective in ("all_reduce", "broadcast", "reduce"):
            kw["count"] = len(bufs[root]["data"])
        elif collective in ("all_gather", "gather"):
            kw["count"] = len(b["input"])
            if collective == "all_gather" or r == root:
                b["output"] = _junk(world * kw["count"], dtype)
        elif collective == "scatter":
            kw["count"] = len(bufs[root]["input"]) // world
            b["output"] = _junk(kw["count"], dtype)
        elif collective == "reduce_scatter":
            kw["counts"] = tuple(kwargs.get("counts") or split(len(b["input"]), world))
            b["output"] = _junk(kw["counts"][r], dtype)
        elif collective == "all_to_all":
            matrix = kwargs.get("send_counts")
            if matrix is None:  # equal blocks
                matrix = [split(len(x["input"]), world) for x in bufs]
            kw["send_counts"] = tuple(matrix[r])
            kw["recv_counts"] = tuple(row[r] for row in matrix)
            b["output"] = _junk(sum(kw["recv_counts"]), dtype)
        elif collective == "barrier":
            b["token"] = np.zeros(0, dtype)
    return kws, bufs, dtype


# -- running ----------------------------------------------------------------------------


def simulate(collective: str, algorithm: str, world: int, inputs: list[Buffers],
             op: Callable | str | None = None, **kwargs) -> list[Buffers]:
    """Run ``algorithm`` for ``collective`` on ``world`` ranks; return each rank's buffers
    (all but ``scratch``).  ``inputs[r]`` holds rank r's input buffers by name ("data",
    or "input"; a non-root rank of scatter passes {}).  ``op`` is a binary ufunc or a
    name in :data:`OPS` (default sum).  Keyword arguments go to the algorithm (root,
    segment, counts); all_to_all takes ``send_counts`` as a W x W matrix (row i: what
    rank i sends to each rank), by default equal blocks.  Raises :class:`ScheduleError`.
    """
    fn, reduce_op = find_algorithm(collective, algorithm), _op(op)
    kws, bufs, dtype = _layout(collective, world, inputs, kwargs)
    schedules = [fn(r, world, **kw) for r, kw in enumerate(kws)]
    for b, sched in zip(bufs, schedules, strict=True):
        b["scratch"] = _junk(sched.scratch, dtype)
    execute(schedules, bufs, reduce_op)
    return [{name: arr for name, arr in b.items() if name != "scratch"} for b in bufs]


def execute(schedules: Sequence[Schedule], bufs: list[Buffers],
            op: Callable | str | None = None) -> None:
    """Run rank r's ``schedules[r]`` over its buffers ``bufs[r]`` (changed in place) with
    the semantics above; for hand-made schedules.  Raises :class:`ScheduleError`."""
    world, op = len(schedules), _op(op)
    queues: dict[tuple[int, int, int], deque] = defaultdict(deque)
    pc, waiting = [0] * world, [None] * world  # waiting[r]: unmatched Recvs of a started step
    todo, queued = deque(range(world)), [True] * world
    while todo:
        r = todo.popleft()
        queued[r] = False
        steps = schedules[r].steps
        while pc[r] < len(steps):
            if waiting[r] is None:
                waiting[r] = _start(r, pc[r], steps[pc[r]], bufs[r], world, queues, op)
                for peer in {o.peer for o in steps[pc[r]] if isinstance(o, Send)}:
                    if not queued[peer]:
                        todo.append(peer)
                        queued[peer] = True
            left = []
            for recv in waiting[r]:
                queue = queues.get((recv.peer, r, recv.tag))
                if queue:
                    _deliver(r, recv, queue.popleft(), bufs[r], op)
                else:
                    left.append(recv)
            if left:
                waiting[r] = left
                break
            waiting[r], pc[r] = None, pc[r] + 1
    _check_finished(schedules, pc, waiting, queues)


def _start(rank: int, index: int, step: Step, bufs: Buffers, world: int, queues,
           op: Callable) -> list[Recv]:
    """Check the step, post its sends (copies of the data now), do its copies (reducing
    ones combine ``dst = op(dst, src)``)."""
    _check_step(rank, index, step, bufs, world)
    for o in step:
        if isinstance(o, Send):
            queues[(rank, o.peer, o.tag)].append(_view(bufs, o.src).copy())
    for o in step:
        if isinstance(o, Copy):
            dst = _view(bufs, o.dst)
            dst[:] = op(dst, _view(bufs, o.src)) if o.reduce else _view(bufs, o.src)
    return [o for o in step if isinstance(o, Recv)]


def _deliver(rank: int, recv: Recv, message: np.ndarray, bufs: Buffers, op: Callable) -> None:
    if message.size != recv.dst.count:
        raise ScheduleError(f"rank {rank}: {recv} matched a message of {message.size} "
                            f"elements from rank {recv.peer}; sizes must agree")
    dst = _view(bufs, recv.dst)
    dst[:] = op(dst, message) if recv.reduce else message


def _view(bufs: Buffers, region: Region) -> np.ndarray:
    return bufs[region.buffer][region.offset:region.offset + region.count]


def _check_finished(schedules, pc, waiting, queues) -> None:
    stuck = [r for r, s in enumerate(schedules) if pc[r] < len(s.steps)]
    if stuck:
        lines = [f"rank {r} at step {pc[r]} of {len(schedules[r].steps)} waits for "
                 + ", ".join(f"rank {o.peer} (tag {o.tag})" for o in (waiting[r] or ()))
                 for r in stuck[:8]]
        raise ScheduleError("deadlock: no rank can make progress; "
                            + "; ".join(lines) + (" ..." if len(stuck) > 8 else ""))
    extra = [f"{len(q)} from rank {src} to rank {dst} with tag {tag}"
             for (src, dst, tag), q in queues.items() if q]
    if extra:
        raise ScheduleError("messages sent but never received: " + "; ".join(extra[:8]))


def _check_step(rank: int, index: int, step: Step, bufs: Buffers, world: int) -> None:
    where = f"rank {rank} step {index}"
    touched: dict[str, list] = defaultdict(list)  # buffer -> (start, end, writes, op)
    for o in step:
        if isinstance(o, Send | Recv) and not (0 <= o.peer < world and o.peer != rank):
            raise ScheduleError(f"{where}: {o} names peer {o.peer}, which is not another "
                                f"rank of the group 0..{world - 1} (use Copy for local moves)")
        if isinstance(o, Copy) and o.src.count != o.dst.count:
            raise ScheduleError(f"{where}: {o} copies between regions of different sizes")
        regions = ((o.src, False),) if isinstance(o, Send) else ((o.dst, True),) \
            if isinstance(o, Recv) else ((o.src, False), (o.dst, True))
        for region, writes in regions:
            _check_region(where, o, region, bufs)
            if region.count:
                touched[region.buffer].append((region.offset, region.offset + region.count,
                                               writes, o))
    for buffer, items in touched.items():
        items.sort(key=lambda item: item[0])
        end_any = end_write = 0
        by_any = by_write = None
        for start, end, writes, o in items:
            other = by_any if writes and start < end_any else \
                by_write if not writes and start < end_write else None
            if other is not None:
                raise ScheduleError(f"{where}: {o} and {other} overlap in buffer {buffer!r}; "
                                    "a step may not write a region it also reads or writes")
            if end > end_any:
                end_any, by_any = end, o
            if writes and end > end_write:
                end_write, by_write = end, o


def _check_region(where: str, o, region: Region, bufs: Buffers) -> None:
    if region.buffer not in bufs:
        raise ScheduleError(f"{where}: {o} uses buffer {region.buffer!r}, which this rank "
                            f"does not have (it has {', '.join(sorted(bufs))})")
    size = len(bufs[region.buffer])
    if region.offset < 0 or region.count < 0 or region.offset + region.count > size:
        raise ScheduleError(f"{where}: {o} is outside buffer {region.buffer!r} "
                            f"({size} elements)")


def _op(op: Callable | str | None) -> Callable:
    if op is None or callable(op):
        return op or np.add
    if op not in OPS:
        raise ValueError(f"unknown reduce op {op!r}; valid: {', '.join(OPS)}")
    return OPS[op]


# -- the expected result ----------------------------------------------------------------


def reference(collective: str, world: int, inputs: list[Buffers],
              op: Callable | str | None = None, **kwargs) -> list[Buffers]:
    """What :func:`simulate` must return, computed directly with numpy."""
    op, root = _op(op), kwargs.get("root", 0)
    kws, bufs, _ = _layout(collective, world, inputs, kwargs)
    if collective in ("all_reduce", "reduce", "reduce_scatter"):
        name = "input" if collective == "reduce_scatter" else "data"
        total = functools.reduce(op, [b[name] for b in bufs])
    for r, (kw, b) in enumerate(zip(kws, bufs, strict=True)):
        if collective == "all_reduce" or collective == "reduce" and r == root:
            b["data"] = total.copy()
        elif collective == "broadcast":
            b["data"] = bufs[root]["data"].copy()
        elif "output" in b and collective in ("all_gather", "gather"):
            b["output"] = np.concatenate([x["input"] for x in bufs])
        elif collective == "scatter":
            b["output"] = bufs[root]["input"][r * kw["count"]:(r + 1) * kw["count"]].copy()
        elif collective == "reduce_scatter":
            start = offsets(kw["counts"])[r]
            b["output"] = total[start:start + kw["counts"][r]].copy()
        elif collective == "all_to_all":
            b["output"] = np.concatenate([_a2a_block(x, kws[i], r) for i, x in enumerate(bufs)])
    return bufs


def _a2a_block(b: Buffers, kw: dict, dst: int) -> np.ndarray:
    start = offsets(kw["send_counts"])[dst]
    return b["input"][start:start + kw["send_counts"][dst]]


def check(collective: str, algorithm: str, world: int, count=0, *, root: int = 0,
          dtype=np.int64, op: Callable | str = "sum", seed: int = 0,
          **kwargs) -> list[Buffers]:
    """Simulate on random inputs and compare with :func:`reference` (exactly, except for
    floats); raise AssertionError naming the first wrong rank and buffer.

    ``count``: elements per rank's data/input for all_reduce, broadcast, reduce,
    all_gather and gather; per block for scatter; the input total, split as evenly as
    possible, for reduce_scatter (or a tuple of counts); for all_to_all an int (equal
    blocks) or a W x W matrix of send counts."""
    rng = np.random.default_rng(seed)
    if collective in ROOTED:
        kwargs["root"] = root
    sizes = [count] * world
    if collective == "scatter":
        sizes = [world * count if r == root else None for r in range(world)]
    elif collective == "reduce_scatter":
        counts = split(count, world) if np.ndim(count) == 0 else tuple(count)
        sizes, kwargs["counts"] = [sum(counts)] * world, counts
    elif collective == "all_to_all":
        matrix = [(count,) * world] * world if np.ndim(count) == 0 else count
        sizes, kwargs["send_counts"] = [sum(row) for row in matrix], matrix
    name = "data" if collective in ("all_reduce", "broadcast", "reduce") else "input"
    inputs = [{} if n is None or collective == "barrier" else {name: _random(rng, n, dtype)}
              for n in sizes]
    got = simulate(collective, algorithm, world, inputs, op, **kwargs)
    want = reference(collective, world, inputs, op, **kwargs)
    same = np.array_equal if np.dtype(dtype).kind not in "fc" else np.allclose
    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in sorted(set(g) | set(w)):
            if key not in g or key not in w or not same(g[key], w[key]):
                raise AssertionError(f"{collective}/{algorithm} W={world} {kwargs}: rank {r} "
                                     f"{key!r} is {g.get(key)}, expected {w.get(key)}")
    return got


def _random(rng: np.random.Generator, n: int, dtype) -> np.ndarray:
    kind = np.dtype(dtype).kind
    if kind in "fc":
        return rng.standard_normal(n).astype(dtype)
    if kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    low = 0 if kind == "u" else -50
    return rng.integers(low, 50, n).astype(dtype)


# -- the cost model ---------------------------------------------------------------------


def element_count(nbytes: int, itemsize: int = 4) -> int:
    """Elements in ``nbytes`` bytes; ValueError unless it divides evenly."""
    if nbytes < 0 or nbytes % itemsize:
        raise ValueError(f"{nbytes} bytes is not a whole number of {itemsize}-byte elements")
    return nbytes // itemsize


def predict(collective: str, algorithm: str, world: int | GpuTopology, nbytes: int, *,
            alpha: float | None = None, beta: float | None = None, gamma: float | None = None,
            itemsize: int | None = None, **kwargs) -> float:
    """Seconds the alpha-beta-gamma model gives for one call of the collective.

    ``nbytes`` is the size nccl-tests reports: the data of all_reduce, broadcast and
    reduce, the whole output of all_gather and gather, the root's whole input of
    scatter, every rank's whole input of reduce_scatter and all_to_all.  Each step that
    moves messages costs ``alpha + beta * max(bytes sent, bytes received) + gamma *
    bytes reduced`` (alpha 5 us, beta 1 / 10 GB/s, gamma beta / 4 unless given); local
    copies are free.  A rank's time is the sum over its steps; the result is the slowest
    of ranks 0, 1, root, W//2, W-1.

    With a :class:`GpuTopology` as ``world``, ``algorithm`` is "ring", "tree" or
    "hierarchical" and the keyword arguments are chorus.sim.gpu.estimate's (``rail``,
    ``protocol``, ``overlap``); :func:`estimate` also gives the bus bandwidth::

        >>> predict("all_reduce", "tree", GpuTopology.h100(hosts=512), 8) < 1e-4
        True
    """
    if isinstance(world, GpuTopology):
        flat = {"alpha": alpha, "beta": beta, "gamma": gamma, "itemsize": itemsize}
        if any(v is not None for v in flat.values()):
            raise InvalidArgumentError(f"predict({collective!r}, {algorithm!r}, GpuTopology): "
                             f"{', '.join(k for k, v in flat.items() if v is not None)} "
                             "belong to the flat model; a GpuTopology carries its own links")
        return estimate(collective, algorithm, world, nbytes, **kwargs).seconds
    alpha = 5e-6 if alpha is None else alpha
    beta = 1 / 10e9 if beta is None else beta
    itemsize = 4 if itemsize is None else itemsize
    gamma = beta / 4 if gamma is None else gamma
    n = element_count(nbytes, itemsize)
    fn, root = find_algorithm(collective, algorithm), kwargs.get("root", 0)
    if collective in ROOTED:
        kwargs["root"] = root
    if collective in ("all_gather", "gather", "scatter"):
        kwargs["count"] = n // world
    elif collective == "reduce_scatter":
        kwargs["counts"] = split(n, world)
    elif collective == "all_to_all":
        kwargs["send_counts"] = kwargs["recv_counts"] = (n // world,) * world
    elif collective != "barrier":
        kwargs["count"] = n
    ranks = sorted({0, 1, root, world // 2, world - 1} & set(range(world)))
    return max(_cost(fn(r, world, **kwargs), alpha, beta * itemsize, gamma * itemsize)
               for r in ranks)


def _cost(schedule: Schedule, alpha: float, per_elem: float, reduce_per_elem: float) -> float:
    total = 0.0
    for step in schedule.steps:
        sent = received = reduced = 0
        moves = False
        for o in step:
            if type(o) is Send:
                sent, moves = sent + o.src.count, True
            elif type(o) is Recv:
                received, moves = received + o.dst.count, True
                reduced += o.dst.count if o.reduce else 0
        if moves:
            total += alpha + per_elem * max(sent, received) + reduce_per_elem * reduced
    return total
