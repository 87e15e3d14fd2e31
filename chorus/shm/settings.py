"""chorus's numeric settings from the environment (``CHORUS_SHM_*`` and the like)."""

from __future__ import annotations

import os


def env_int(name: str, default: int) -> int:
    """Environment variable ``name`` as a whole number (``default`` if unset or empty);
    a value that is not one raises ValueError naming the variable."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: give a whole number (default {default})") from None
