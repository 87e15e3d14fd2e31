"""Debugging a distributed job: the flight recorder (chorus.debug.flight) and its reader,
``chorus analyze`` (chorus.debug.analyze).  See docs/debugging.md.

    from chorus.debug import dump_flight_recorder
    dump_flight_recorder("/tmp/fr/rank0.json")     # this rank's last ops, every group
"""

from chorus.debug.flight import dump_flight_recorder

__all__ = ["dump_flight_recorder"]
