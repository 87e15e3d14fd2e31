"""The collective grid (tests/test_collectives_grid.py): every collective x dtype x reduce
op x root x group, run inside the ranks of one job, checked against numpy.

Numpy only (no torch), so that the grid runs where torch is not installed.  A job calls
``run_grid(rank, world, workdir)`` on every rank: each rank runs every case of
``cases(world)`` in order and returns a :class:`Report` (the component its world group
runs on, how many cases it ran per collective, and the mismatches).  The expected values
come from numpy alone: the reduction of the members' inputs, their concatenation, a
slice -- never from chorus.

Inputs are small integers (products of at most 4 factors of magnitude <= 2), so every
reduction is exact in every dtype and every order: results must be equal bit for bit
on every component (tree, ring, shared memory, hierarchical).
"""

from __future__ import annotations

import collections
import functools
import os
import zlib
from dataclasses import dataclass, field

import numpy as np

import chorus as dist

DTYPES = ("float32", "float64", "float16", "int32", "int64", "uint8", "bool", "complex64")
FLOAT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM")
COMPLEX_OPS = ("SUM", "PRODUCT", "AVG", "PREMUL_SUM")
INT_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
COLLECTIVES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier")
PREMUL_FACTOR = 0.5
SMALL = 7  # elements: odd, so no block divides evenly by accident
LARGE = 300_000  # float32 elements (1.2 MB): more than a shared-memory slot of 4 ranks, past the small-message algorithms
SUB_DTYPES = ("int64", "float32")  # the sub-group runs these
#: collectives whose input on each rank is a block per rank: their large case has LARGE in all
WHOLE = ("reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "scatter")


def ops_for(dtype: str) -> tuple[str, ...]:
    """Every reduce op defined for ``dtype`` (chorus.reductions' table)."""
    if dtype == "bool" or dtype.startswith(("int", "uint")):
        return INT_OPS
    return COMPLEX_OPS if dtype.startswith("complex") else FLOAT_OPS


@dataclass(frozen=True)
class Case:
    """One call of ``collective`` on every rank.  ``root`` is a rank of the group the case
    runs on (``sub``: the ranks 1..W-1, else the world); ``variant`` picks a form of the
    call (all_to_all_single: "even" without split sizes, "uneven" with them)."""

    collective: str
    dtype: str = "int64"
    op: str | None = None
    root: int | None = None
    sub: bool = False
    async_op: bool = False
    n: int = SMALL
    variant: str = ""

    def __str__(self) -> str:
        parts = [self.collective, self.dtype, self.op, None if self.root is None else f"root={self.root}",
                 "sub" if self.sub else None, "async" if self.async_op else None,
                 None if self.n == SMALL else f"n={self.n}", self.variant or None]
        return " ".join(p for p in parts if p)


def _one(collective: str, size: int, sub: bool, large: bool) -> list[Case]:
    """The cases of one collective on a group of ``size`` ranks."""
    dtypes = SUB_DTYPES if sub else DTYPES
    roots = range(size) if collective in ROOTED else [None]
    if collective == "barrier":
        return [Case("barrier", sub=sub)] + ([] if sub else [Case("barrier", async_op=True)])
    out = []
    for dtype in dtypes:
        if collective in REDUCING:
            for op in ops_for(dtype):
                for root in (roots if op == "SUM" else [size - 1] if collective == "reduce" else [None]):
                    out.append(Case(collective, dtype, op, root, sub))
        else:
            for root in roots:
                for variant in (("even", "uneven") if collective == "all_to_all_single" else ("",)):
                    out.append(Case(collective, dtype, None, root, sub, variant=variant))
    if sub:
        return out
    last = None if roots == [None] else size - 1
    op = "SUM" if collective in REDUCING else None
    variant = "uneven" if collective == "all_to_all_single" else ""
    out.append(Case(collective, "float32", op, last, async_op=True, variant=variant))
    if large:
        out.append(Case(collective, "float32", op, last, n=LARGE, variant=variant))
    return out


def cases(world: int, large: bool = True) -> list[Case]:
    """Every case of a job of ``world`` ranks, in the order every rank runs them: the world
    group's, then (for 3+ ranks) the sub-group's of ranks 1..W-1.  ``large``: with a
    LARGE case per collective."""
    out = [case for coll in COLLECTIVES for case in _one(coll, world, False, large)]
    if world >= 3:
        out += [case for coll in COLLECTIVES for case in _one(coll, world - 1, True, large)]
    return out


def members(case: Case, world: int) -> list[int]:
    return list(range(1, world)) if case.sub else list(range(world))


# -- inputs and what numpy says the results are ------------------------------------------------
def value(case: Case, rank: int, shape, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input (the same in every process): small integers in ``case.dtype``,
    a pattern that differs by case, rank and salt.  A fresh copy (callers write into it)."""
    return _value(case, rank, shape, salt).copy()


@functools.lru_cache(maxsize=64)  # the ranks of a thread job, and the expected values, share them
def _value(case: Case, rank: int, shape, salt: int) -> np.ndarray:
    seed = zlib.crc32(repr((str(case), rank, salt)).encode())
    i = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    mix = (i * (seed % 7 + 3) + i // 5 + seed) % 101  # 0..100, period >> the number of ranks
    dtype = case.dtype
    if dtype == "bool":
        return (mix % 2).astype(bool)
    if case.op == "PRODUCT":
        pool = np.array([1, 2, 3] if dtype == "uint8" else [-2, -1, 1, 2])
        v = pool[mix % len(pool)]
        if dtype.startswith("complex"):
            return (v + 1j * (mix // 4 % 3 - 1)).astype(dtype)
        return v.astype(dtype)
    v = mix if dtype == "uint8" else mix % 17 - 8
    if dtype.startswith("complex"):
        return (v + 1j * (mix // 17 % 17 - 8)).astype(dtype)
    return v.astype(dtype)


_NUMPY = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum, "BAND": np.bitwise_and,
          "BOR": np.bitwise_or, "BXOR": np.bitwise_xor, "AVG": np.add, "PREMUL_SUM": np.add}
_BOOL = {"SUM": np.logical_or, "PRODUCT": np.logical_and, "MIN": np.logical_and, "MAX": np.logical_or,
         "BAND": np.logical_and, "BOR": np.logical_or, "BXOR": np.logical_xor}


def reference(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    """``op`` over ``arrays`` as torch defines it (AVG: the sum divided by the count, in the
    dtype; PREMUL_SUM: the sum of each input times the factor)."""
    if op == "PREMUL_SUM":
        arrays = [np.multiply(a, PREMUL_FACTOR).astype(a.dtype) for a in arrays]
    fn = (_BOOL if arrays[0].dtype == bool else _NUMPY)[op]
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = fn(out, a).astype(out.dtype)
    if op == "AVG":
        out = np.divide(out, len(arrays)).astype(out.dtype)
    return out


def reduce_op(op: str):
    return dist._make_nccl_premul_sum(PREMUL_FACTOR) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)


def a2a_rows(i: int, j: int) -> int:
    """Rows group rank i sends group rank j in the uneven all_to_all_single (0 included)."""
    return (i + 2 * j) % 3


def a2a_block(i: int, j: int, n: int) -> int:
    """Elements group rank i sends group rank j in all_to_all (uneven blocks)."""
    return n + (i + j) % 3


# -- one case on one rank: (what it returned, what numpy expects) ------------------------------
def run_case(case: Case, rank: int, world: int, group, workdir: str) -> tuple[list, list]:
    """Run ``case`` on this rank; return (outputs, expected outputs), both lists of arrays
    (a non-member's output: what the call returned and its untouched input)."""
    ranks = members(case, world)
    kw = {"group": group} if case.sub else {}
    if case.op is not None:
        kw["op"] = reduce_op(case.op)
    if case.async_op:
        kw["async_op"] = True
    w = len(ranks)
    n = case.n // w if case.n == LARGE and case.collective in WHOLE else case.n
    mine = value(case, rank, n)
    if rank not in ranks:  # a non-member: the call returns None and leaves everything alone
        keep = mine.copy()
        returned = getattr(dist, case.collective)(*_non_member_args(case, mine), **kw)
        return [returned, mine], [None, keep]
    me = ranks.index(rank)
    root = None if case.root is None else ranks[case.root]  # a global rank, as torch takes it
    inputs = {r: value(case, r, n) for r in ranks}
    coll = case.collective

    def call(fn, *args, **extra):
        work = fn(*args, **kw, **extra)
        if case.async_op:
            work.wait()
            assert work.is_completed(), "wait() returned before the op completed"
        else:
            assert work is None, f"{coll} returned {work!r} without async_op"

    if coll == "broadcast":
        call(dist.broadcast, mine, src=root)
        return [mine], [inputs[root]]
    if coll == "all_reduce":
        call(dist.all_reduce, mine)
        return [mine], [reference(case.op, list(inputs.values()))]
    if coll == "reduce":
        keep = mine.copy()
        call(dist.reduce, mine, dst=root)
        return [mine], [reference(case.op, list(inputs.values())) if rank == root else keep]
    if coll == "all_gather":
        outs = [np.zeros(n, case.dtype) for _ in ranks]
        call(dist.all_gather, outs, mine)
        return outs, [inputs[r] for r in ranks]
    if coll == "all_gather_into_tensor":
        out = np.zeros((w, n), case.dtype)
        call(dist.all_gather_into_tensor, out, mine)
        return [out], [np.stack([inputs[r] for r in ranks])]
    if coll == "gather":
        outs = [np.zeros(n, case.dtype) for _ in ranks] if rank == root else None
        call(dist.gather, mine, gather_list=outs, dst=root)
        return (outs, [inputs[r] for r in ranks]) if rank == root else ([], [])
    if coll == "scatter":
        out = np.zeros(n, case.dtype)
        parts = [value(case, root, n, salt=1 + i) for i in range(w)] if rank == root else None
        call(dist.scatter, out, parts, src=root)
        return [out], [value(case, root, n, salt=1 + me)]
    if coll == "reduce_scatter":  # uneven: group rank q's block has n + q elements
        ins = [value(case, rank, n + q, salt=1 + q) for q in range(w)]
        out = np.zeros(n + me, case.dtype)
        call(dist.reduce_scatter, out, ins)
        return [out], [reference(case.op, [value(case, r, n + me, salt=1 + me) for r in ranks])]
    if coll == "reduce_scatter_tensor":
        full = value(case, rank, n * w, salt=1)
        out = np.zeros(n, case.dtype)
        call(dist.reduce_scatter_tensor, out, full)
        blocks = [value(case, r, n * w, salt=1)[me * n:(me + 1) * n] for r in ranks]
        return [out], [reference(case.op, blocks)]
    if coll == "all_to_all":  # uneven blocks: i sends j a2a_block(i, j, n) elements
        ins = [value(case, rank, a2a_block(me, j, n), salt=1 + j) for j in range(w)]
        outs = [np.zeros(a2a_block(i, me, n), case.dtype) for i in range(w)]
        call(dist.all_to_all, outs, ins)
        return outs, [value(case, r, a2a_block(i, me, n), salt=1 + me) for i, r in enumerate(ranks)]
    if coll == "all_to_all_single":
        if case.variant == "even":
            full = value(case, rank, n * w, salt=1)
            out = np.zeros(n * w, case.dtype)
            call(dist.all_to_all_single, out, full)
            return [out], [np.concatenate([value(case, r, n * w, salt=1)[me * n:(me + 1) * n] for r in ranks])]
        # uneven: rows of 2 elements; i sends j a2a_rows(i, j) rows (some none)
        send = [a2a_rows(me, j) for j in range(w)]
        recv = [a2a_rows(i, me) for i in range(w)]
        full = value(case, rank, (sum(send), 2), salt=1)
        out = np.zeros((sum(recv), 2), case.dtype)
        call(dist.all_to_all_single, out, full, output_split_sizes=recv, input_split_sizes=send)
        expect = []
        for i, r in enumerate(ranks):
            theirs = value(case, r, (sum(a2a_rows(i, j) for j in range(w)), 2), salt=1)
            start = sum(a2a_rows(i, j) for j in range(me))
            expect.append(theirs[start:start + a2a_rows(i, me)])
        return [out], [np.concatenate(expect)]
    if coll == "barrier":
        def mark(r):
            return os.path.join(workdir, f"arrived-{case}-{r}".replace(" ", "-"))

        open(mark(rank), "w").close()
        call(dist.barrier)
        arrived = [r for r in ranks if os.path.exists(mark(r))]
        return [np.array(arrived)], [np.array(ranks)]  # nobody leaves before everyone came
    raise AssertionError(coll)


def _non_member_args(case: Case, mine: np.ndarray) -> tuple:
    """Arguments a non-member passes (torch lets them be anything shaped right)."""
    coll, n = case.collective, case.n
    if coll in ("broadcast", "all_reduce", "reduce"):
        return (mine,) + ((1,) if coll != "all_reduce" else ())
    if coll == "all_gather":
        return ([np.zeros(n, case.dtype)], mine)
    if coll == "all_gather_into_tensor":
        return (np.zeros(n, case.dtype), mine)
    if coll in ("gather", "scatter"):
        return (mine, None, 1)
    if coll in ("reduce_scatter", "all_to_all"):
        return (mine, [mine])
    if coll in ("reduce_scatter_tensor", "all_to_all_single"):
        return (mine, mine.copy())
    return ()


# -- the whole grid on one rank ----------------------------------------------------------------
@dataclass
class Report:
    """What one rank of a grid job saw."""

    rank: int
    component: str  # the world group's: "shm", "hierarchical" or "p2p" (schedules over TCP or loopback)
    transport: str  # the world group's transport class
    ran: collections.Counter = field(default_factory=collections.Counter)  # collective -> cases run
    wrong: list = field(default_factory=list)  # (case, what differs)


def component(group) -> str:
    """Which component runs ``group``'s collectives (chorus.api.launch.run's choice)."""
    if group.hierarchy is not None:
        return "hierarchical"
    return "shm" if group.shm is not None else "p2p"


def same(got, expected) -> str:
    """'' when ``got`` equals ``expected`` bit for bit (dtype and shape too), else why not."""
    if got is None or expected is None:
        return "" if got is expected else f"got {got!r}, expected {expected!r}"
    got = np.asarray(got)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return f"got {got.dtype}{list(got.shape)}, expected {expected.dtype}{list(expected.shape)}"
    if not np.array_equal(got, expected):
        return f"got {got.ravel()[:8]}, expected {expected.ravel()[:8]}"
    return ""


def run_grid(rank: int, world: int, workdir: str, large: bool = True, only: str | None = None) -> Report:
    """Every case of ``cases(world, large)`` (``only``: of that collective) on this rank;
    stops at the first exception (the ranks are out of step after it)."""
    world_group = dist.group.WORLD
    report = Report(rank, component(world_group), type(world_group.transport).__name__)
    sub = dist.new_group(list(range(1, world))) if world >= 3 else None
    for case in cases(world, large):
        if only is not None and case.collective != only:
            continue
        try:
            outs, expected = run_case(case, rank, world, sub, workdir)
        except Exception as exc:  # noqa: BLE001 - reported with the case
            report.wrong.append((str(case), f"{type(exc).__name__}: {exc}"))
            break
        report.ran[case.collective] += 1
        if len(outs) != len(expected):
            report.wrong.append((str(case), f"{len(outs)} outputs, expected {len(expected)}"))
            continue
        for i, (got, exp) in enumerate(zip(outs, expected, strict=True)):
            why = same(got, exp)
            if why:
                report.wrong.append((str(case), f"output {i}: {why}"))
    return report
