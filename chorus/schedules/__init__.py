"""Algorithms as pure functions that return schedules (see DESIGN.md, "The schedule model")."""

from chorus.schedules.barrier import dissemination_barrier
from chorus.schedules.base import Copy, Recv, Region, Schedule, Send, Step

__all__ = ["Copy", "Recv", "Region", "Schedule", "Send", "Step", "dissemination_barrier"]
