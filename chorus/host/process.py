"""Whether a process of this host still exists, by pid (for files and waits that name
their creator: shared-memory segments, the derived job secret, the benchmark's turns)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists (another user's process included: signal 0 is
    then refused, but the process is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
