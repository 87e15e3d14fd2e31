"""A walkthrough: an algorithm's steps, who moves which block to whom, and what every rank
holds after each step.

The contents are symbolic.  A reducing collective (all_reduce, reduce, reduce_scatter)
tracks, per element, the set of ranks whose input is in it (a bit mask, combined with OR);
a cell shows it as ``a+b+c``, or ``Σ`` once every rank's input is in.  The other
collectives track where each element came from (origin rank and position): a cell shows
``b`` (rank 1's block) or ``b2`` (block 2 of rank 1's input).  ``·`` is a cell nothing has
written yet.  Ranks are letters a, b, c, ... (r26, r27, ... beyond z).

``schedule_walk`` runs the real schedules (chorus.schedules) in rounds with chorus.sim's
semantics: in each round every rank whose previous step ended starts its next step
(posts its sends — the data is taken then — and does its copies); a step ends in the
first round in which each of its receives has found its message (FIFO per sender, tag).
It then runs chorus.sim on the same schedules and inputs and checks both end in the same
place, and ``chorus.sim.check`` checks the algorithm on random numbers.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from chorus import sim
from chorus.schedules.base import Copy, Recv, Region, Send
from chorus.schedules.chunks import offsets, split
from chorus.schedules.registry import algorithm as find_algorithm

REDUCING = ("all_reduce", "reduce", "reduce_scatter")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
STRIDE = 1 << 32  # origin id of element i of rank r's input: r * STRIDE + i
JUNK = -1  # an element nothing wrote yet (movement collectives; reductions use mask 0)


def letter(rank: int) -> str:
    return chr(ord("a") + rank) if rank < 26 else f"r{rank}"


@dataclass
class Action:
    """One thing a holder (a rank, or the shared window) does in a step."""

    holder: int
    kind: str  # send, recv, copy, reduce, sync, read, write
    peer: int  # the other holder, or -1
    region: str  # "data[2]", "output[0-1]"
    content: str  # the label of what moves, "a+d"
    nbytes: int
    text: str  # the sentence the terminal prints
    arrows: list[tuple[int, int]] = field(default_factory=list)  # (from holder, to holder) drawn
    op: tuple[int, int, int] = ()  # (rank, step, index in the step) of the schedule op it comes from


@dataclass
class Step:
    """One round (schedules) or phase (shared memory): its actions and the state after it.
    ``state[h][buffer]`` is a list of cells ``(label, hue, fill)``: hue the origin rank of a
    moved block (-1: none or several), fill how much of the reduction it holds (0..1)."""

    title: str
    actions: list[Action]
    state: list[dict[str, list[tuple[str, int, float]]]]
    note: str = ""
    ends: dict[int, int] = field(default_factory=dict)  # rank -> index of its schedule step that ended here


@dataclass
class Walkthrough:
    collective: str
    algorithm: str
    world: int
    count: int  # elements per rank, as the algorithm's arguments count them
    itemsize: int
    kind: str  # "schedule" (message passing) or "phases" (the shared-memory window)
    doc: str  # the algorithm's docstring: its theory of operation
    holders: list[str]
    initial: list[dict[str, list[tuple[str, int, float]]]]
    steps: list[Step] = field(default_factory=list)
    footer: list[str] = field(default_factory=list)
    root: int = 0

    def to_dict(self) -> dict:
        return {"collective": self.collective, "algorithm": self.algorithm, "world": self.world,
                "count": self.count, "itemsize": self.itemsize, "kind": self.kind, "doc": self.doc,
                "holders": self.holders, "root": self.root, "initial": self.initial,
                "steps": [{"title": s.title, "note": s.note, "state": s.state,
                           "actions": [a.__dict__ for a in s.actions]} for s in self.steps],
                "footer": self.footer}


# -- sizes and buffers --------------------------------------------------------------------


def count_for(collective: str, world: int, nbytes: int, itemsize: int = 4) -> int:
    """Elements per rank for a message of ``nbytes`` as nccl-tests (and chorus.sim.predict)
    size it: the data of all_reduce, broadcast and reduce; the whole output of all_gather
    and gather; the root's whole input of scatter; every rank's whole input of
    reduce_scatter and all_to_all.  all_gather/gather/scatter: per rank's block."""
    n = max(0, nbytes // itemsize)
    if collective in ("all_gather", "gather", "scatter", "all_to_all"):
        return max(1, n // world)
    if collective == "reduce_scatter":
        return max(world, n)
    return max(1, n)


def arguments(collective: str, world: int, count: int, root: int) -> dict:
    """The schedule function's keyword arguments (after rank and world)."""
    if collective == "barrier":
        return {}
    if collective == "reduce_scatter":
        return {"counts": split(count, world)}
    if collective == "all_to_all":
        return {"send_counts": (count,) * world, "recv_counts": (count,) * world}
    kw = {"count": count}
    if collective in ROOTED:
        kw["root"] = root
    return kw


def cell_sizes(collective: str, world: int, count: int, root: int, rank: int) -> dict[str, list[int]]:
    """How the terminal and the page cut each buffer of ``rank`` into cells (element counts)."""
    if collective in ("all_reduce", "reduce", "broadcast"):
        return {"data": [c for c in split(count, world) if c] or [count]}
    if collective in ("all_gather", "gather"):
        out = {"input": [count]}
        if collective == "all_gather" or rank == root:
            out["output"] = [count] * world
        return out
    if collective == "scatter":
        out = {"output": [count]}
        if rank == root:
            out = {"input": [count] * world, **out}
        return out
    if collective == "reduce_scatter":
        counts = split(count, world)
        return {"input": list(counts), "output": [counts[rank]]}
    if collective == "all_to_all":
        return {"input": [count] * world, "output": [count] * world}
    return {}


def initial_buffers(collective: str, world: int, count: int, root: int, rank: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s symbolic buffers before the op (scratch is added per schedule)."""
    sizes = {name: sum(cells) for name, cells in cell_sizes(collective, world, count, root, rank).items()}
    junk = 0 if collective in REDUCING else JUNK
    bufs = {name: np.full(n, junk, np.int64) for name, n in sizes.items()}
    if collective in REDUCING:
        name = "input" if collective == "reduce_scatter" else "data"
        bufs[name][:] = 1 << rank
    elif collective == "broadcast":
        if rank == root:
            bufs["data"][:] = rank * STRIDE + np.arange(count)
    elif "input" in bufs:
        bufs["input"][:] = rank * STRIDE + np.arange(sizes["input"])
    if collective == "barrier":
        bufs["token"] = np.zeros(0, np.int64)
        bufs["heard"] = np.array([1 << rank], np.int64)  # whom this rank has heard from
    return bufs


# -- labels -------------------------------------------------------------------------------


class Labeller:
    """Turns symbolic cells into labels (see the module docstring)."""

    def __init__(self, collective: str, world: int, count: int, root: int):
        self.reducing = collective in REDUCING or collective == "barrier"
        self.world = world
        self.full = (1 << world) - 1
        # where the blocks of each rank's input start (movement collectives)
        self.origin_cells = []
        for r in range(world):
            sizes = cell_sizes(collective, world, count, root, r)
            cells = sizes.get("data" if collective == "broadcast" else "input", [])
            self.origin_cells.append(list(offsets(cells)) if len(cells) > 1 else [])

    def mask(self, m: int) -> str:
        if m == 0:
            return "·"
        if m == self.full:
            return "Σ"
        return "+".join(letter(r) for r in range(self.world) if m >> r & 1)

    def cell(self, values: np.ndarray) -> tuple[str, int, float]:
        if values.size == 0:
            return ("", -1, 0.0)
        if self.reducing:
            union = int(np.bitwise_or.reduce(values))
            partial = bool((values != values[0]).any())
            fill = bin(union).count("1") / self.world
            hue = union.bit_length() - 1 if union and union & (union - 1) == 0 else -1
            return (self.mask(union) + ("*" if partial else ""), hue, fill)
        filled = values[values != JUNK]
        if filled.size == 0:
            return ("·", -1, 0.0)
        labels, ranks = [], []
        for r in sorted({int(v) // STRIDE for v in filled}):
            ranks.append(r)
            starts = self.origin_cells[r]
            if starts:
                idx = sorted({bisect.bisect_right(starts, int(v) % STRIDE) - 1 for v in filled if int(v) // STRIDE == r})
                whole = len(idx) == len(starts)  # every block of the input: the rank's letter alone
                labels.append(letter(r) + ("" if whole else ",".join(str(i) for i in idx)))
            else:
                labels.append(letter(r))
        partial = filled.size < values.size
        return ("".join(labels) + ("*" if partial else ""), ranks[0] if len(ranks) == 1 else -1,
                filled.size / values.size)

    def of(self, values: np.ndarray) -> str:
        return self.cell(values)[0]


def snapshot(bufs: dict[str, np.ndarray], cells: dict[str, list[int]], labeller: Labeller,
             extra: tuple[str, ...] = ()) -> dict[str, list[tuple[str, int, float]]]:
    """The cells of every buffer of one holder (``extra``: buffers shown whole, one cell)."""
    out = {}
    for name, sizes in cells.items():
        arr = bufs[name]
        out[name] = [labeller.cell(arr[a: a + n]) for a, n in zip(offsets(sizes), sizes, strict=True)]
    for name in extra:
        if name in bufs and bufs[name].size:
            out[name] = [labeller.cell(bufs[name])]
    return out


def region_text(region: Region, cells: dict[str, list[int]]) -> str:
    """``data[2]`` (cell 2), ``output[0-1]`` (cells 0 to 1), or ``scratch{3..5}`` (elements)."""
    sizes = cells.get(region.buffer)
    if sizes:
        starts = list(offsets(sizes))
        ends = [s + n for s, n in zip(starts, sizes, strict=True)]
        end = region.offset + region.count
        if region.offset in starts and end in ends:
            a, b = starts.index(region.offset), ends.index(end)
            if a == 0 and b == len(sizes) - 1:
                return region.buffer  # all of it
            return f"{region.buffer}[{a}]" if a == b else f"{region.buffer}[{a}-{b}]"
    if region.count == 0:
        return region.buffer
    return f"{region.buffer}{{{region.offset}..{region.offset + region.count - 1}}}"


# -- message-passing schedules, in rounds -----------------------------------------------------


def _view(bufs: dict[str, np.ndarray], region: Region) -> np.ndarray:
    return bufs[region.buffer][region.offset: region.offset + region.count]


#: Elements (all ranks) followed one by one; a larger op is followed at the size of one
#: element per cell when its schedules have the same shape (steps, peers, tags), with the
#: bytes of the real size.
FOLLOWED = 1 << 16


def _shape(schedule) -> list:
    return [[(type(o).__name__, getattr(o, "peer", -1), getattr(o, "tag", 0), getattr(o, "reduce", False))
             for o in step] for step in schedule.steps]


def schedule_walk(collective: str, algorithm: str, world: int, count: int, *, root: int = 0,
                  itemsize: int = 4, check: bool = True) -> Walkthrough:
    """The walkthrough of ``algorithm`` for ``collective`` on ``world`` ranks, ``count``
    elements per rank (as :func:`arguments` passes them).  ValueError for an op too large
    to follow whose schedules change shape with its size."""
    fn = find_algorithm(collective, algorithm)
    real = [fn(r, world, **arguments(collective, world, count, root)) for r in range(world)]
    if count * world > FOLLOWED and collective != "barrier":
        small = count_for(collective, world, world * itemsize, itemsize)
        schedules = [fn(r, world, **arguments(collective, world, small, root)) for r in range(world)]
        if any(_shape(a) != _shape(b) for a, b in zip(schedules, real, strict=True)):
            raise ValueError(f"{count} elements per rank are too many to follow one by one, and {algorithm}'s "
                             "steps change with the size; pass a smaller --bytes")
        walk = schedule_walk(collective, algorithm, world, small, root=root, itemsize=itemsize, check=check)
        sizes = [[[o.src.count if isinstance(o, (Send, Copy)) else o.dst.count for o in step] for step in s.steps]
                 for s in real]
        walk.count = count
        _rescale(walk, sizes, itemsize)
        if check:
            walk.footer[-1:] = [f"followed at {small} element(s) per rank (the same steps); the bytes are "
                                f"those of {count} elements", _predict(collective, algorithm, world, count, root,
                                                                       real, itemsize)]
        return walk
    schedules = real
    bufs = [initial_buffers(collective, world, count, root, r) for r in range(world)]
    junk = 0 if collective in REDUCING else JUNK
    cells = []
    for r, sched in enumerate(schedules):
        bufs[r]["scratch"] = np.full(sched.scratch, junk, np.int64)
        c = cell_sizes(collective, world, count, root, r)
        unit = max(1, next(iter(c.values()), [1])[0]) if c else 1
        if sched.scratch:
            c["scratch"] = [min(unit, sched.scratch - a) for a in range(0, sched.scratch, unit)]
        cells.append(c)
    if collective == "barrier":
        for r in range(world):
            cells[r]["heard"] = [1]
    labeller = Labeller(collective, world, count, root)
    start = [{k: v.copy() for k, v in b.items()} for b in bufs]
    walk = Walkthrough(collective, algorithm, world, count, itemsize, "schedule", (fn.__doc__ or "").strip(),
                       [f"rank {r}" for r in range(world)],
                       [snapshot(bufs[r], cells[r], labeller) for r in range(world)], root=root)
    walk.steps = _rounds(schedules, bufs, cells, labeller, itemsize, collective == "barrier")
    if check:
        walk.footer = _check(collective, algorithm, world, count, root, schedules, start, bufs, itemsize)
    return walk


def _rounds(schedules, bufs, cells, labeller: Labeller, itemsize: int, barrier: bool) -> list[Step]:
    world = len(schedules)
    pc, pending = [0] * world, [None] * world
    queues: dict[tuple[int, int, int], deque] = defaultdict(deque)
    out: list[Step] = []
    while any(pc[r] < len(schedules[r].steps) for r in range(world)):
        actions: list[Action] = []
        progress = False
        for r in range(world):
            if pending[r] is not None or pc[r] >= len(schedules[r].steps):
                continue
            progress = True
            step = schedules[r].steps[pc[r]]
            for j, o in enumerate(step):
                if isinstance(o, Send):
                    data = _view(bufs[r], o.src).copy()
                    heard = int(bufs[r]["heard"][0]) if barrier else 0
                    queues[(r, o.peer, o.tag)].append((data, heard))
                    what = region_text(o.src, cells[r])
                    content = labeller.mask(heard) if barrier else labeller.of(data)
                    actions.append(Action(r, "send", o.peer, what, content, o.src.count * itemsize,
                                          f"rank {r} sends {what} ({content}) to rank {o.peer}", op=(r, pc[r], j)))
            for j, o in enumerate(step):
                if isinstance(o, Copy):
                    dst = _view(bufs[r], o.dst)
                    src = _view(bufs[r], o.src)
                    dst[:] = np.bitwise_or(dst, src) if o.reduce else src
                    a, b = region_text(o.src, cells[r]), region_text(o.dst, cells[r])
                    actions.append(Action(r, "reduce" if o.reduce else "copy", -1, b, labeller.of(src),
                                          o.src.count * itemsize,
                                          f"rank {r} {'reduces' if o.reduce else 'copies'} {a} into {b}",
                                          op=(r, pc[r], j)))
            pending[r] = [(j, o) for j, o in enumerate(step) if isinstance(o, Recv)]
        ends = {}
        for r in range(world):
            if pending[r] is None:
                continue
            left = []
            for j, o in pending[r]:
                queue = queues.get((o.peer, r, o.tag))
                if not queue:
                    left.append((j, o))
                    continue
                data, heard = queue.popleft()
                dst = _view(bufs[r], o.dst)
                dst[:] = np.bitwise_or(dst, data) if o.reduce else data
                if barrier:
                    bufs[r]["heard"][0] |= heard
                what = region_text(o.dst, cells[r])
                content = labeller.mask(heard) if barrier else labeller.of(data)
                verb = "reduces into" if o.reduce else "receives into"
                actions.append(Action(r, "recv", o.peer, what, content, o.dst.count * itemsize,
                                      f"rank {r} {verb} {what} ({content}) from rank {o.peer}",
                                      [(o.peer, r)], (r, pc[r], j)))
                progress = True
            if left:
                pending[r] = left
            else:
                ends[r] = pc[r]
                pending[r], pc[r] = None, pc[r] + 1
        if not progress:
            raise sim.ScheduleError("deadlock: no rank can make progress")
        state = [snapshot(bufs[r], cells[r], labeller) for r in range(world)]
        out.append(Step(f"step {len(out) + 1}", actions, state, ends=ends))
    return out


def _rescale(walk: Walkthrough, sizes, itemsize: int) -> None:
    """Give the actions of a walkthrough followed at a small size the bytes of the real one
    (``sizes[r][step][op]``: elements of the real schedules' ops, same shape)."""
    for step in walk.steps:
        for a in step.actions:
            if a.op:
                r, i, j = a.op
                a.nbytes = sizes[r][i][j] * itemsize


def _check(collective: str, algorithm: str, world: int, count: int, root: int, schedules, start, end,
           itemsize: int) -> list[str]:
    """chorus.sim on the same schedules and symbolic inputs must end where the rounds did;
    chorus.sim.check on random numbers; the alpha-beta model's time."""
    lines = []
    if collective != "barrier":
        bufs = [{k: v for k, v in b.items() if k != "heard"} for b in start]
        sim.execute(schedules, bufs, np.bitwise_or)
        same = all(np.array_equal(bufs[r][k], end[r][k]) for r in range(world) for k in bufs[r])
        if not same:
            raise AssertionError(f"{collective}/{algorithm}: the rounds and chorus.sim disagree")
        kw = {"root": root} if collective in ROOTED else {}
        amount = count if collective != "reduce_scatter" else split(count, world)
        sim.check(collective, algorithm, world, amount, **kw)
        lines.append("chorus.sim ran the same schedules: every rank ends as shown, and on random "
                     "int64 inputs every rank's result equals numpy's")
    return [*lines, _predict(collective, algorithm, world, count, root, schedules, itemsize)]


def _predict(collective: str, algorithm: str, world: int, count: int, root: int, schedules, itemsize: int) -> str:
    nbytes = _nccl_bytes(collective, world, count, itemsize)
    seconds = sim.predict(collective, algorithm, world, nbytes, itemsize=itemsize,
                          **({"root": root} if collective in ROOTED else {}))
    steps = max(len(s.steps) for s in schedules)
    return (f"{steps} steps on the longest rank; alpha-beta model (5 us per message step, "
            f"10 GB/s): {seconds * 1e6:.1f} us for {nbytes} bytes")


def _nccl_bytes(collective: str, world: int, count: int, itemsize: int) -> int:
    if collective in ("all_gather", "gather", "scatter", "all_to_all"):
        return count * world * itemsize
    if collective == "barrier":
        return 0
    return count * itemsize
