"""A collective call's fingerprint: the 64 bits every collective frame carries so that a
receiver can tell that its peer called something else — and say what.

It is an encoding, not a hash, so the receiving rank can name the peer's call::

    bits  0-5   collective (COLLECTIVES index + 1)
    bits  6-10  dtype code (chorus.wire.dtypes)
    bits 11-14  reduce op (REDUCE_OPS index + 1, 0 = none)
    bits 15-30  root + 1 (0 = no root; roots above 65534 are folded)
    bits 31-63  element count (saturates at 2**33 - 1)
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from chorus.wire.dtypes import DTYPE_CODES, dtype_name

COLLECTIVES = ("barrier", "broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter",
               "reduce_scatter", "all_to_all", "monitored_barrier")
REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM")
_MAX_COUNT = (1 << 33) - 1
_MAX_ROOT = (1 << 16) - 2


@functools.lru_cache(maxsize=4096)
def fingerprint(op: str, dtype: str = "bytes", count: int = 0, root: int = -1, reduce_op: str = "") -> int:
    """Encode a call; ``op`` must be one of COLLECTIVES.  Never 0."""
    code = COLLECTIVES.index(op) + 1
    red = REDUCE_OPS.index(reduce_op) + 1 if reduce_op else 0
    r = 0 if root < 0 else min(root, _MAX_ROOT) + 1
    return code | DTYPE_CODES[dtype] << 6 | red << 11 | r << 15 | min(count, _MAX_COUNT) << 31


def describe(fp: int) -> str:
    """``"all_reduce(float32, count=1024, op=SUM)"`` for a fingerprint."""
    code = fp & 0x3F
    if not 1 <= code <= len(COLLECTIVES):
        return f"<unknown call {fp:#x}>"
    parts = [dtype_name((fp >> 6) & 0x1F), f"count={fp >> 31}"]
    root = (fp >> 15) & 0xFFFF
    if root:
        parts.append(f"root={root - 1}")
    red = (fp >> 11) & 0xF
    if red:
        parts.append(f"op={REDUCE_OPS[red - 1] if red <= len(REDUCE_OPS) else red}")
    return f"{COLLECTIVES[code - 1]}({', '.join(parts)})"


def describe_calls(calls: dict[int, tuple[int, int]], members: Iterable[int] = ()) -> str:
    """Who called what, one clause per distinct call (by lowest rank), then the
    ``members`` whose call is not known::

        {0: (1, a), 2: (1, a), 1: (1, b)}, members 0..3  ->
        "ranks [0, 2] called all_reduce(float32, count=1024, op=SUM) as op #1;
         rank 1 called broadcast(float32, count=1024, root=0) as op #1; rank 3: not known"

    ``calls`` maps a global rank to (op number, fingerprint) of its call."""
    by_call: dict[tuple[int, int], list[int]] = {}
    for rank in sorted(calls):
        by_call.setdefault(calls[rank], []).append(rank)
    clauses = [f"{ranks_text(ranks)} called {describe(fp)} as op #{seq}" for (seq, fp), ranks in by_call.items()]
    unknown = sorted(set(members) - set(calls))
    if unknown:
        clauses.append(f"{ranks_text(unknown)}: not known")
    return "; ".join(clauses)


def ranks_text(ranks: list[int]) -> str:
    """``"rank 3"``, ``"ranks [0, 2]"``, ``"ranks [0-63, 65]"`` (runs of 3 or more folded)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run)) for run in runs]
    return f"ranks [{', '.join(parts)}]"


def describe_report(calls: dict[int, tuple[int, int]], members: list[int],
                    seen: tuple[int, int, int, int] | None) -> str:
    """What a mismatch message adds when the calls known do not differ: the first report
    of a rank found not to match (``seen``: culprit, detector, seq, fingerprint, the rank
    that found it named as such, not blamed), and, every call known, that the same call
    ran different ways."""
    if seen is not None:
        culprit, detector, seq, fprint = seen
        if calls.get(culprit) != (seq, fprint):  # (the first word about that rank named another call)
            return f"; rank {detector} found rank {culprit} calling {describe(fprint)} as op #{seq}"
    if calls and set(members) <= calls.keys():
        who = "" if seen is None else f"rank {seen[1]} found rank {seen[0]} running it another way; "
        return (f": the same call, run different ways ({who}algorithm=, CHORUS_ALGO_* and CHORUS_TRANSPORT "
                "must be the same on every rank)")
    if seen is not None:  # (some calls not known yet)
        return f"; rank {seen[1]} found that rank {seen[0]}'s call does not match its own"
    return ""
