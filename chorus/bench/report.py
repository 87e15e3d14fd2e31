"""The result table: nccl-tests columns for each library, plus chorus's speed-up over
each baseline; the rows merged from every rank; the JSON document."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from chorus.bench.sizes import human

#: busbw = algbw * factor(W), as nccl-tests defines it.
BUS_FACTOR = {
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "all_to_all": lambda w: (w - 1) / w,
    "broadcast": lambda w: 1.0,
    "reduce": lambda w: 1.0,
    "sendrecv": lambda w: 1.0,
    "barrier": lambda w: 0.0,
}

#: Libraries in the order of the table's columns.
LIBRARY_ORDER = ("chorus", "gloo", "mpi")


@dataclass
class Row:
    library: str
    collective: str
    nbytes: int
    count: int
    dtype: str
    op: str
    seconds: float  # mean per op on rank 0
    wrong: int  # wrong elements over all iterations (summed over ranks once merged)
    world: int

    @property
    def algbw(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def busbw(self) -> float:
        return self.algbw * BUS_FACTOR[self.collective](self.world)


def _by_round(rows: list[Row]) -> list[tuple[tuple[str, int, int], Row]]:
    """Each row keyed (library, size, round): a size's k-th row of a library is round k."""
    seen: dict[tuple[str, int], int] = {}
    out = []
    for r in rows:
        k = seen.get((r.library, r.nbytes), 0)
        seen[(r.library, r.nbytes)] = k + 1
        out.append(((r.library, r.nbytes, k), r))
    return out


def merge_ranks(per_rank: dict[int, list[Row]]) -> list[Row]:
    """One row per (library, size, round): rank 0's time, the wrong elements of every rank."""
    wrong: dict[tuple[str, int, int], int] = {}
    for rows in per_rank.values():
        for key, r in _by_round(rows):
            wrong[key] = wrong.get(key, 0) + r.wrong
    return [Row(**{**asdict(r), "wrong": wrong[key]}) for key, r in _by_round(per_rank.get(0, []))]


def medians(rows: list[Row]) -> tuple[list[Row], dict[tuple[str, int], list[float]]]:
    """Rows of several rounds (``merge_ranks``) as one row per (library, size): the median
    of the rounds' times (an even number of rounds: the mean of the middle two; a baseline
    that gave up part-way: over the rounds it ran) and every round's wrong elements; and
    each (library, size)'s times, round by round."""
    times: dict[tuple[str, int], list[float]] = {}
    first: dict[tuple[str, int], Row] = {}
    wrong: dict[tuple[str, int], int] = {}
    for r in rows:
        key = (r.library, r.nbytes)
        times.setdefault(key, []).append(r.seconds)
        first.setdefault(key, r)
        wrong[key] = wrong.get(key, 0) + r.wrong
    return ([Row(**{**asdict(r), "seconds": statistics.median(times[key]), "wrong": wrong[key]})
             for key, r in first.items()], times)


def round_speedups(times: dict[tuple[str, int], list[float]], baseline: str,
                   mine: str = "chorus") -> dict[int, list[float]]:
    """``mine``'s speed-up over ``baseline`` per size, round by round (``medians``' times)."""
    return {n: [b / c for b, c in zip(seconds, times[(mine, n)], strict=False) if c]
            for (lib, n), seconds in times.items() if lib == baseline and (mine, n) in times}


def format_rounds(times: dict[tuple[str, int], list[float]]) -> str:
    """Per size, the range of chorus's speed-up over each baseline across the rounds."""
    baselines = [lib for lib in _ordered({lib for lib, _ in times}) if lib != "chorus"]
    ranges = {lib: round_speedups(times, lib) for lib in baselines}
    head = f"{'size':>7} |" + "".join(f" {'vs ' + lib + ', each round':>22}" for lib in baselines)
    lines = [head, "-" * len(head)]
    for size in sorted({n for _, n in times}):
        line = f"{human(size):>7} |"
        for lib in baselines:
            got = ranges[lib].get(size)
            line += f" {f'{min(got):.2f}-{max(got):.2f}x ({len(got)})':>22}" if got else f" {'-':>22}"
        lines.append(line)
    return "\n".join(lines)


def libraries(rows: list[Row]) -> list[str]:
    """The libraries present, chorus first, then the baselines in LIBRARY_ORDER."""
    return _ordered({r.library for r in rows})


def _ordered(present: set[str]) -> list[str]:
    order = {name: i for i, name in enumerate(LIBRARY_ORDER)}
    return sorted(present, key=lambda name: (order.get(name, len(order)), name))


def speedups(rows: list[Row], baseline: str) -> dict[int, float]:
    """chorus's speed-up over ``baseline`` per size (baseline time / chorus time)."""
    chorus = {r.nbytes: r.seconds for r in rows if r.library == "chorus"}
    return {r.nbytes: r.seconds / chorus[r.nbytes] for r in rows
            if r.library == baseline and chorus.get(r.nbytes)}


def format_table(rows: list[Row]) -> str:
    """One line per size, within 100 columns for chorus and two baselines: the size, each
    library's mean time (us) and busbw (GB/s), chorus's speed-up over each baseline
    ("vs gloo" = gloo's time / chorus's time), and #wrong, the wrong elements of every
    library together.  The rest (count, dtype, op, algbw, each library's #wrong) is in the
    ``--json`` document (:func:`to_json`)."""
    libs = libraries(rows)
    by = {(r.library, r.nbytes): r for r in rows}
    sizes = sorted({r.nbytes for r in rows})
    others = [lib for lib in libs if lib != "chorus"]
    ratios = {lib: speedups(rows, lib) for lib in others}
    head = f"{'size':>7}" + "".join(f" | {lib + ' us':>10} {'busbw':>6}" for lib in libs)
    if others:
        head += " |" + "".join(f" {'vs ' + lib:>8}" for lib in others)
    head += f" | {'#wrong':>6}"
    lines = [head, "-" * len(head)]
    for size in sizes:
        line = f"{human(size):>7}"
        for lib in libs:
            r = by.get((lib, size))
            line += f" | {r.seconds * 1e6:>10.1f} {r.busbw:>6.2f}" if r else f" | {'-':>10} {'-':>6}"
        if others:
            line += " |" + "".join(f" {ratios[lib][size]:>7.2f}x" if size in ratios[lib] else f" {'-':>8}"
                                   for lib in others)
        wrong = sum(by[(lib, size)].wrong for lib in libs if (lib, size) in by)
        lines.append(line + f" | {wrong:>6}")
    return "\n".join(lines)


def to_json(rows: list[Row], meta: dict[str, Any],
            times: dict[tuple[str, int], list[float]] | None = None) -> dict[str, Any]:
    """The ``--json`` document: the run's settings (``meta``) and one entry per row with
    its derived figures (algbw, busbw in GB/s; speedup_vs_<baseline> on chorus rows);
    ``times`` (several rounds: ``medians``) adds each row's ``rounds_us`` and, on chorus
    rows, ``speedup_vs_<baseline>_rounds``."""
    others = [lib for lib in libraries(rows) if lib != "chorus"]
    ratios = {lib: speedups(rows, lib) for lib in others}
    per_round = {lib: round_speedups(times, lib) for lib in others} if times else {}
    out = []
    for r in rows:
        entry: dict[str, Any] = {**asdict(r), "us": r.seconds * 1e6, "algbw": r.algbw,
                                 "busbw": r.busbw}
        if times:
            entry["rounds_us"] = [t * 1e6 for t in times[(r.library, r.nbytes)]]
        if r.library == "chorus":
            for lib in others:
                if r.nbytes in ratios[lib]:
                    entry[f"speedup_vs_{lib}"] = ratios[lib][r.nbytes]
                if r.nbytes in per_round.get(lib, {}):
                    entry[f"speedup_vs_{lib}_rounds"] = per_round[lib][r.nbytes]
        out.append(entry)
    return {**meta, "rows": out}
