"""Starting the processes of a job: the ``chorusrun`` CLI and :func:`spawn`."""

from chorus.launch.cli import main
from chorus.launch.spawn import (
    ProcessException,
    ProcessExitedException,
    ProcessRaisedException,
    SpawnContext,
    spawn,
)

__all__ = [
    "main",
    "spawn",
    "SpawnContext",
    "ProcessException",
    "ProcessRaisedException",
    "ProcessExitedException",
]
