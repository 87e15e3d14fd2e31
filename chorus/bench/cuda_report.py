"""The report of ``chorus bench --device cuda`` (chorus.bench.cuda): the ranks' rows
merged (rank 0's times, every rank's wrong elements), rounds reduced to their medians,
and the tables.  A row is a dict: library, nbytes, count, seconds (GPU time per call),
cpu_seconds (CPU time per call), wrong (-1: not checked), iters, round (0 without
``--rounds``)."""

from __future__ import annotations

import json
import os
import statistics

from chorus.bench.report import round_speedups
from chorus.bench.sizes import human

BUS = {"all_reduce": lambda w: 2 * (w - 1) / w, "all_gather": lambda w: (w - 1) / w,
       "reduce_scatter": lambda w: (w - 1) / w, "all_to_all": lambda w: (w - 1) / w, "broadcast": lambda w: 1.0}


def merge(workdir: str, world: int) -> tuple[list[dict], list[str]]:
    """Rank 0's rows from the ranks' files in ``workdir``, each with the wrong elements
    of every rank for that library, size and round (-1 where a rank could not check),
    and every rank's notes once."""
    per_rank = {}
    notes: list[str] = []
    for r in range(world):
        try:
            with open(os.path.join(workdir, f"rows-{r}.json")) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        per_rank[r] = data["rows"]
        notes += [n for n in data["notes"] if n not in notes]
    wrong: dict = {}
    for rows in per_rank.values():
        for row in rows:
            k = _key(row)
            wrong[k] = -1 if row["wrong"] < 0 or wrong.get(k, 0) < 0 else wrong.get(k, 0) + row["wrong"]
    rows = [dict(row, wrong=wrong[_key(row)]) for row in per_rank.get(0, [])]
    if len(per_rank) < world:
        notes.append(f"only {len(per_rank)} of {world} ranks wrote results")
    return rows, notes


def _key(row: dict) -> tuple:
    return row["library"], row["nbytes"], row.get("round", 0)


def _label(lib: str) -> str:
    """A library's name in a column of 9 (symm-mem's as s1shot / s2shot; a chorus
    algorithm by its own name, "c:nccl" for chorus's hand-off to NCCL, next to NCCL's own)."""
    if lib == "chorus:nccl":
        return "c:nccl"
    return lib.replace("symm-", "s").replace("chorus:", "")[:9]


def format_table(rows: list[dict], collective: str, world: int, dtype: str) -> str:
    """One line per size, within 100 columns for chorus, NCCL and torch's two symm-mem
    ops: each library's GPU time per call (us), chorus's bus bandwidth (GB/s) and CPU
    time per call (us), each baseline's time over chorus's ("x nccl" > 1: chorus is
    faster), and #wrong, every library's wrong elements together.  The rest (count,
    algbw, every library's busbw, CPU time and #wrong) is in the ``--json`` document."""
    if not rows:
        return f"(no results for {collective})"
    libs = list(dict.fromkeys(r["library"] for r in rows))
    libs.sort(key=lambda lib: (not lib.startswith("chorus"), lib != "chorus", lib))
    by = {(r["library"], r["nbytes"]): r for r in rows}
    mine = "chorus" if any(lib == "chorus" for lib in libs) else libs[0]
    others = [lib for lib in libs if not lib.startswith("chorus")]
    head = (f"{'size':>6}" + "".join(f" {_label(lib) + ' us':>9}" for lib in libs) + f" {'busbw':>6} {'cpu us':>6}"
            + "".join(f" {'x ' + _label(lib)[:6]:>8}" for lib in others) + f" {'#wrong':>6}")
    lines = [head, "-" * len(head)]
    factor = BUS[collective](world)
    for size in sorted({r["nbytes"] for r in rows}):
        line = f"{human(size):>6}"
        for lib in libs:
            r = by.get((lib, size))
            line += f" {r['seconds'] * 1e6:>9.1f}" if r else f" {'-':>9}"
        c = by.get((mine, size))
        busbw = size / c["seconds"] / 1e9 * factor if c and c["seconds"] else None
        line += f" {busbw:>6.1f} {c['cpu_seconds'] * 1e6:>6.1f}" if busbw is not None else f" {'-':>6} {'-':>6}"
        for lib in others:
            r = by.get((lib, size))
            line += f" {r['seconds'] / c['seconds']:>7.2f}x" if r and c and c["seconds"] else f" {'-':>8}"
        checked = [by[(lib, size)]["wrong"] for lib in libs if (lib, size) in by and by[(lib, size)]["wrong"] >= 0]
        lines.append(line + (f" {sum(checked):>6}" if checked else f" {'-':>6}"))  # (-1: not checked)
    return "\n".join(lines)


def median_rows(rows: list[dict]) -> tuple[list[dict], dict[tuple[str, int], list[float]]]:
    """Rows of several rounds (a size's row once per round) as one row per (library,
    size): the median of the rounds' GPU and CPU times per call (an even number of rounds:
    the mean of the middle two) and the wrong elements of the rounds that were checked
    (-1 only where none was); and each (library, size)'s GPU times, round by round."""
    times: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    first: dict[tuple[str, int], dict] = {}
    wrong: dict[tuple[str, int], int] = {}
    for r in rows:
        key = (r["library"], r["nbytes"])
        times.setdefault(key, []).append(r["seconds"])
        cpu.setdefault(key, []).append(r["cpu_seconds"])
        first.setdefault(key, r)
        if r["wrong"] >= 0:
            wrong[key] = max(wrong.get(key, 0), 0) + r["wrong"]
        else:
            wrong.setdefault(key, -1)
    return ([{**{k: v for k, v in r.items() if k != "round"}, "seconds": statistics.median(times[key]),
              "cpu_seconds": statistics.median(cpu[key]), "wrong": wrong[key]} for key, r in first.items()], times)


def format_round_ranges(times: dict[tuple[str, int], list[float]]) -> str:
    """Per size, the lowest and highest over the rounds of each baseline's time over
    chorus's (above 1: chorus is faster), and how many rounds were below 1; a line saying
    so where there is nothing to compare (no result, or no baseline: ``--baseline none``)."""
    others = sorted({lib for lib, _ in times if not lib.startswith("chorus")})
    if not others or len({lib for lib, _ in times}) == len(others):
        return "(no results of both chorus and a baseline to compare round by round)"
    mine = "chorus" if any(lib == "chorus" for lib, _ in times) else min(lib for lib, _ in times
                                                                         if lib.startswith("chorus"))
    head = f"{'size':>6}" + "".join(f" {'x ' + _label(lib) + ', each round':>26}" for lib in others)
    lines = [head, "-" * len(head)]
    speedups = {lib: round_speedups(times, lib, mine) for lib in others}
    for size in sorted({n for _, n in times}):
        line = f"{human(size):>6}"
        for lib in others:
            ratios = speedups[lib].get(size, [])
            below = sum(x < 1 for x in ratios)
            line += (f" {f'{min(ratios):.2f}-{max(ratios):.2f}x ({below} of {len(ratios)} below 1)':>26}"
                     if ratios else f" {'-':>26}")
        lines.append(line)
    return "\n".join(lines)
