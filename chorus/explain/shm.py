"""The shared-memory algorithms as phases (chorus.shm.collectives, chorus.shm.direct).

Inside a host the ranks do not pass messages: each writes into a window every rank maps
(its slot), a sync waits until every rank has written, then each reads what it needs —
or, for large messages, reads the peers' own buffers directly (single copy).  Here each
of them is a list of phases over the ranks and the window (holder W), with the same
symbolic contents as the schedules (chorus.explain.walk); one chunk is shown (large
messages run the same phases chunk by chunk, alternating two parities of slots, so that
copying chunk k+1 in overlaps reducing chunk k).

Algorithm names: ``shm:one_shot`` (all_reduce, reduce: every rank reduces everything,
for small messages), ``shm:rs_ag`` (reduce-scatter + all-gather over the slices of each
chunk, for large ones), ``shm:window`` (the copy path of the other collectives) and
``shm:single_copy`` (chorus.shm.direct: process_vm_readv from the peers' buffers).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np

from chorus.explain.walk import (
    FOLLOWED,
    JUNK,
    REDUCING,
    Action,
    Labeller,
    Step,
    Walkthrough,
    cell_sizes,
    count_for,
    initial_buffers,
    letter,
    snapshot,
)
from chorus.schedules.chunks import offsets, split
from chorus.shm import collectives, direct

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("shm:one_shot", "shm:rs_ag", "shm:single_copy"),
    "reduce": ("shm:one_shot", "shm:rs_ag", "shm:single_copy"),
    "broadcast": ("shm:window", "shm:single_copy"),
    "all_gather": ("shm:window", "shm:single_copy"),
    "gather": ("shm:window",),
    "scatter": ("shm:window", "shm:single_copy"),
    "reduce_scatter": ("shm:window", "shm:single_copy"),
    "all_to_all": ("shm:window", "shm:single_copy"),
    "barrier": ("shm:window",),
}

Where = tuple[int, str, int, int]  # (holder, buffer, first element, elements)


@dataclass
class Move:
    """Rank ``actor`` writes ``dst`` from ``srcs``: a copy (one source) or their reduction."""

    actor: int
    dst: Where
    srcs: list[Where]


def shm_walk(collective: str, algorithm: str, world: int, count: int, *, root: int = 0,
             itemsize: int = 4) -> Walkthrough:
    """The walkthrough of shared-memory ``algorithm`` (see :data:`ALGORITHMS`)."""
    if algorithm not in ALGORITHMS.get(collective, ()):
        raise ValueError(f"unknown shared-memory {collective} algorithm {algorithm!r}; valid: "
                         f"{', '.join(ALGORITHMS.get(collective, ()))}")
    if count * world > FOLLOWED:  # one element a cell: the same phases, the real bytes
        small = count_for(collective, world, world * itemsize, itemsize)
        walk = shm_walk(collective, algorithm, world, small, root=root, itemsize=itemsize)
        for step in walk.steps:
            for a in step.actions:
                a.nbytes = a.nbytes * count // small
        walk.count = count
        walk.footer.append(f"followed at {small} element(s) per rank; the bytes are those of {count} elements")
        return walk
    ranks = [initial_buffers(collective, world, count, root, r) for r in range(world)]
    cells = [cell_sizes(collective, world, count, root, r) for r in range(world)]
    window, window_cells = _window(collective, world, count, algorithm)
    holders = [*ranks, window]
    all_cells = [*cells, window_cells]
    labeller = Labeller(collective, world, count, root)
    walk = Walkthrough(collective, algorithm, world, count, itemsize, "phases", _doc(collective, algorithm),
                       [f"rank {r}" for r in range(world)] + ["window"],
                       [snapshot(h, c, labeller) for h, c in zip(holders, all_cells, strict=True)], root=root)
    for title, moves in _phases(collective, algorithm, world, count, root):
        if moves is None:  # a sync
            actions = [Action(r, "sync", -1, "", "", 0, f"rank {r} raises its counter and waits for the others'")
                       for r in range(world)]
        else:
            actions = _run(moves, holders, all_cells, labeller, itemsize, world)
        walk.steps.append(Step(title, actions, [snapshot(h, c, labeller) for h, c in zip(holders, all_cells,
                                                                                          strict=True)]))
    _check(collective, holders[:world], world, count, root)
    walk.footer = ["every rank ends with the collective's result (checked against the definition); "
                   "one chunk shown: larger messages repeat the phases chunk by chunk, two parities "
                   "of slots in turn"]
    return walk


def _doc(collective: str, algorithm: str) -> str:
    name = {"gather": "all_gather", "reduce": "all_reduce"}.get(collective, collective)
    if algorithm == "shm:single_copy":
        fn = getattr(direct, name, None) if name != "all_to_all" else collectives.all_to_all
        head = inspect.getdoc(direct) or ""
        return (head.split("\n\n")[0] + "\n\n" + (inspect.getdoc(fn) or "")).strip()
    return (inspect.getdoc(getattr(collectives, name)) or "").strip()


def _window(collective: str, world: int, count: int, algorithm: str):
    """The window's buffers (slot per rank, result / area) and their cells."""
    junk = 0 if collective in REDUCING else JUNK
    if algorithm == "shm:single_copy" or collective == "barrier":
        return {}, {}
    if collective in ("all_reduce", "reduce"):
        slot = [c for c in split(count, world) if c] or [count]
        names = {f"slot{r}": slot for r in range(world)}
        if algorithm == "shm:rs_ag":
            names["result"] = slot
    elif collective == "broadcast":
        names = {"area": [c for c in split(count, world) if c] or [count]}
    elif collective in ("all_gather", "gather", "scatter"):
        names = {f"slot{r}": [count] for r in range(world)}
    else:  # reduce_scatter, all_to_all: slot r cut into W pieces, piece q for rank q
        pieces = list(split(count, world)) if collective == "reduce_scatter" else [count] * world
        names = {f"slot{r}": pieces for r in range(world)}
    return {n: np.full(sum(c), junk, np.int64) for n, c in names.items()}, names


def _whole(holder: int, name: str, cells: dict[str, list[int]]) -> Where:
    return (holder, name, 0, sum(cells[name]))


def _block(holder: int, name: str, sizes: list[int], i: int) -> Where:
    return (holder, name, offsets(sizes)[i], sizes[i])


def _phases(collective: str, algorithm: str, world: int, count: int, root: int):
    """[(title, [Move] or None for a sync)]."""
    W, win = world, world
    sync = ("sync", None)
    rw = range(W)
    if collective == "barrier":
        return [sync]
    if collective in ("all_reduce", "reduce"):
        slots = [c for c in split(count, W) if c] or [count]
        n = sum(slots)
        readers = list(rw) if collective == "all_reduce" else [root]
        if algorithm == "shm:single_copy":
            parts = [c for c in split(n, W)]
            moves = [Move(r, (q, "data", offsets(parts)[r], parts[r]),
                          [(p, "data", offsets(parts)[r], parts[r]) for p in rw])
                     for r in rw if parts[r] for q in readers]
            return [("phase 0: publish where data starts", []), sync,
                    ("phase 1: rank r reduces slice r of every rank's data, writes it into the readers' data",
                     moves), sync]
        copy_in = ("phase 0: rank r copies data into its slot", [Move(r, (win, f"slot{r}", 0, n), [(r, "data", 0, n)])
                                                              for r in rw])
        if algorithm == "shm:one_shot":
            return [copy_in, sync, ("phase 1: every reader reduces all slots into its data",
                                    [Move(r, (r, "data", 0, n), [(win, f"slot{q}", 0, n) for q in rw])
                                     for r in readers])]
        parts = list(split(n, W))
        return [copy_in, sync,
                ("phase 1: rank r reduces slice r of every slot into result",
                 [Move(r, (win, "result", offsets(parts)[r], parts[r]),
                       [(win, f"slot{q}", offsets(parts)[r], parts[r]) for q in rw]) for r in rw if parts[r]]),
                sync,
                ("phase 2: every reader copies result into its data",
                 [Move(r, (r, "data", 0, n), [(win, "result", 0, n)]) for r in readers])]
    if collective == "broadcast":
        if algorithm == "shm:single_copy":
            return [("phase 0: publish where data starts", []), sync,
                    ("phase 1: every other rank reads the root's data", [Move(r, (r, "data", 0, count),
                                                                              [(root, "data", 0, count)])
                                                                         for r in rw if r != root]), sync]
        return [("phase 0: the root copies data into the window", [Move(root, (win, "area", 0, count),
                                                                       [(root, "data", 0, count)])]), sync,
                ("phase 1: every other rank copies it out", [Move(r, (r, "data", 0, count), [(win, "area", 0, count)])
                                                             for r in rw if r != root])]
    if collective in ("all_gather", "gather"):
        readers = list(rw) if collective == "all_gather" else [root]
        if algorithm == "shm:single_copy":
            return [("phase 0: publish where input starts", []), sync,
                    ("phase 1: every reader reads block q from rank q's input",
                     [Move(r, (r, "output", q * count, count), [(q, "input", 0, count)]) for r in readers for q in rw]),
                    sync]
        return [("phase 0: rank r copies input into its slot",
                 [Move(r, (win, f"slot{r}", 0, count), [(r, "input", 0, count)]) for r in rw]), sync,
                ("phase 1: every reader copies slot q into block q of output",
                 [Move(r, (r, "output", q * count, count), [(win, f"slot{q}", 0, count)]) for r in readers for q in rw])]
    if collective == "scatter":
        if algorithm == "shm:single_copy":
            return [("phase 0: publish where input starts", []), sync,
                    ("phase 1: rank r reads block r of the root's input",
                     [Move(r, (r, "output", 0, count), [(root, "input", r * count, count)]) for r in rw]), sync]
        return [("phase 0: the root copies block r of input into slot r",
                 [Move(root, (win, f"slot{r}", 0, count), [(root, "input", r * count, count)]) for r in rw]), sync,
                ("phase 1: rank r copies slot r into its output",
                 [Move(r, (r, "output", 0, count), [(win, f"slot{r}", 0, count)]) for r in rw])]
    blocks = list(split(count, W)) if collective == "reduce_scatter" else [count] * W
    starts = offsets(blocks)
    if collective == "reduce_scatter":
        if algorithm == "shm:single_copy":
            return [("phase 0: publish where input starts", []), sync,
                    ("phase 1: rank r reduces block r of every rank's input into its output",
                     [Move(r, (r, "output", 0, blocks[r]), [(q, "input", starts[r], blocks[r]) for q in rw])
                      for r in rw if blocks[r]]), sync]
        return [("phase 0: rank r copies block q of input into piece q of its slot",
                 [Move(r, (win, f"slot{r}", starts[q], blocks[q]), [(r, "input", starts[q], blocks[q])])
                  for r in rw for q in rw if blocks[q]]), sync,
                ("phase 1: rank r reduces piece r of every slot into its output",
                 [Move(r, (r, "output", 0, blocks[r]), [(win, f"slot{q}", starts[r], blocks[r]) for q in rw])
                  for r in rw if blocks[r]])]
    # all_to_all
    if algorithm == "shm:single_copy":
        return [("phase 0: publish where input starts, and the counts", []), sync,
                ("phase 1: rank q reads block q of every rank r's input into block r of its output",
                 [Move(q, (q, "output", starts[r], count), [(r, "input", starts[q], count)]) for q in rw for r in rw]),
                sync]
    return [("phase 0: rank r copies block q of input into piece q of its slot",
             [Move(r, (win, f"slot{r}", starts[q], count), [(r, "input", starts[q], count)]) for r in rw for q in rw]),
            sync,
            ("phase 1: rank q copies piece q of slot r into block r of its output",
             [Move(q, (q, "output", starts[r], count), [(win, f"slot{r}", starts[q], count)]) for q in rw for r in rw])]


def _run(moves: list[Move], holders, cells, labeller: Labeller, itemsize: int, world: int) -> list[Action]:
    """Do a phase: every read before any write (the phase's sync made them safe)."""
    def view(w: Where) -> np.ndarray:
        h, name, a, n = w
        return holders[h][name][a: a + n]

    def name(w: Where) -> str:
        h, buf, a, n = w
        who = "window" if h == world else f"rank {h}'s"
        sizes = cells[h].get(buf, [])
        starts = list(offsets(sizes))
        part = ""
        if len(sizes) > 1 and a in starts and sizes[starts.index(a)] == n:
            part = f"[{starts.index(a)}]"
        elif len(sizes) > 1 and n != sum(sizes):
            part = f"{{{a}..{a + n - 1}}}"
        return f"{who} {buf}{part}"

    writes = []
    actions = []
    for m in moves:
        rows = [view(s).copy() for s in m.srcs]
        value = rows[0] if len(rows) == 1 else np.bitwise_or.reduce(np.stack(rows), axis=0)
        writes.append((m.dst, value))
        label = labeller.of(value)
        if len(m.srcs) == 1:
            text = f"rank {m.actor}: {name(m.dst)} <- {name(m.srcs[0])} ({label})"
            kind = "write" if m.dst[0] != m.actor else "read" if m.srcs[0][0] != m.actor else "copy"
            peer = m.dst[0] if m.dst[0] != m.actor else m.srcs[0][0]
        else:
            text = f"rank {m.actor}: {name(m.dst)} <- reduce of {len(m.srcs)} rows ({label})"
            kind, peer = "reduce", m.dst[0] if m.dst[0] != m.actor else m.srcs[-1][0]
        arrows = sorted({(src[0], m.dst[0]) for src in m.srcs if src[0] != m.dst[0]})
        actions.append(Action(m.actor, kind, peer if peer != m.actor else -1, name(m.dst), label,
                              value.size * itemsize, text, arrows))
    for dst, value in writes:
        view(dst)[:] = value
    return actions


def _check(collective: str, ranks, world: int, count: int, root: int) -> None:
    """Every rank's buffers as the collective defines them (AssertionError otherwise)."""
    full = (1 << world) - 1
    for r, b in enumerate(ranks):
        if collective == "all_reduce" or (collective == "reduce" and r == root):
            ok = (b["data"] == full).all()
        elif collective == "reduce_scatter":
            ok = (b["output"] == full).all()
        elif collective == "broadcast":
            ok = (b["data"] == root * (1 << 32) + np.arange(count)).all()
        elif collective in ("all_gather", "gather") and "output" in b:
            ok = (b["output"] == np.concatenate([q * (1 << 32) + np.arange(count) for q in range(world)])).all()
        elif collective == "scatter":
            ok = (b["output"] == root * (1 << 32) + r * count + np.arange(count)).all()
        elif collective == "all_to_all":
            ok = (b["output"] == np.concatenate([q * (1 << 32) + r * count + np.arange(count)
                                                 for q in range(world)])).all()
        else:
            ok = True
        if not ok:
            raise AssertionError(f"{collective}: rank {r} ({letter(r)}) does not end with the result")
