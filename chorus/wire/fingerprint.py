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
