"""torch where it is installed: ``torch`` (None without it) and ``needs_torch``, a mark
that skips a test without it -- chorus's core and its tests run without torch (the CI
runs them in an environment without torch, .ci/run)."""

from __future__ import annotations

import pytest

try:
    import torch
except ImportError:  # pragma: no cover - the CI's run without torch
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch (pip install 'chorus[torch]')")
