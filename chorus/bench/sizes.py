"""Message-size arguments (``8``, ``64K``, ``256M``) and the sweep ``-b .. -e, x -f``."""

from __future__ import annotations

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864.  ValueError says what is accepted."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B") if text.strip().upper() not in ("B",) else ""
    unit = t[-1:] if t[-1:] in _UNITS else ""
    number = t[: len(t) - len(unit)]
    try:
        value = int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"bad size {text!r}: use a byte count with an optional K, M or G suffix") from None
    if value < 0:
        raise ValueError(f"bad size {text!r}: must not be negative")
    return value


def sweep(begin: int, end: int, factor: int) -> list[int]:
    """Sizes from ``begin`` to ``end`` inclusive, multiplying by ``factor``."""
    if factor < 2:
        raise ValueError("the size factor -f must be at least 2")
    sizes, size = [], max(begin, 1) if begin == 0 else begin
    if begin == 0:
        sizes.append(0)
    while size <= end:
        sizes.append(size)
        size *= factor
    return sizes


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)
