"""A collective call's fingerprint: a 64-bit hash of what must match on every rank."""

from __future__ import annotations

import hashlib


def fingerprint(op: str, dtype: str = "", count: int = 0, root: int = -1, reduce_op: str = "") -> int:
    """Stable across processes and machines (unlike ``hash()``); never 0."""
    text = f"{op}|{dtype}|{count}|{root}|{reduce_op}".encode()
    value = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    return value or 1


def describe_call(op: str, dtype: str = "", count: int = 0, root: int = -1, reduce_op: str = "") -> str:
    """The same fields as text, for error messages."""
    parts = [op]
    if dtype:
        parts.append(f"dtype={dtype}")
    if count:
        parts.append(f"count={count}")
    if root >= 0:
        parts.append(f"root={root}")
    if reduce_op:
        parts.append(f"op={reduce_op}")
    return " ".join(parts)
