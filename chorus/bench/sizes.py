"""Message-size arguments (``8``, ``64K``, ``256M``, ``1KiB``) and the sweep ``-b .. -e, x -f``."""

from __future__ import annotations

import math

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864 (binary units: K = 1024; ``64MB``, ``64MiB`` and ``64m`` too).
    ValueError says what is accepted."""
    t = text.strip().upper()
    if t.endswith("IB"):
        t = t[:-2]
    elif t.endswith("B"):
        t = t[:-1]
    unit = t[-1:] if t[-1:] in _UNITS else ""
    number = t[: len(t) - len(unit)].strip()
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"bad size {text!r}: use a whole byte count with an optional K, M or G "
                         "suffix (e.g. 8, 1K, 256M)")
    if value < 0:
        raise ValueError(f"bad size {text!r}: must not be negative")
    return int(value)


def sweep(begin: int, end: int, factor: int) -> list[int]:
    """Sizes from ``begin`` to ``end`` inclusive, multiplying by ``factor`` (a begin of 0
    gives 0, then 1, factor, factor**2, ...)."""
    if factor < 2:
        raise ValueError("the size factor -f must be at least 2")
    if begin < 0 or end < 0:
        raise ValueError("sizes must not be negative")
    if begin > end:
        raise ValueError(f"the smallest size -b ({human(begin)}) is larger than the largest -e ({human(end)})")
    sizes, size = [], begin
    if begin == 0:
        sizes.append(0)
        size = 1
    while size <= end:
        sizes.append(size)
        size *= factor
    return sizes


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)
