"""Starting the processes of a job: the ``chorusrun`` CLI and :func:`spawn`."""

from chorus.launch.cli import main
from chorus.launch.spawn import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    SpawnContext,
    get_start_method,
    set_start_method,
    spawn,
)

__all__ = [
    "main",
    "spawn",
    "set_start_method",
    "get_start_method",
    "SpawnContext",
    "ProcessException",
    "ProcessRaisedException",
    "ProcessExitedException",
]
