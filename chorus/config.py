"""Placeholder until the configuration module lands (replaced by the full declaration)."""

from __future__ import annotations

import os

_DEFAULTS = {"CHORUS_SEGMENT_BYTES": 1 << 20}


def get(name: str):
    text = os.environ.get(name, "").strip()
    default = _DEFAULTS.get(name, "")
    if not text:
        return default
    return int(text) if isinstance(default, int) else text
