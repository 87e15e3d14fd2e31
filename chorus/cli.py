"""The ``chorus`` command: ``chorus bench ...``, ``chorus config`` (every ``CHORUS_*``
setting's effective value, as ``python -m chorus.config``), ``chorus run`` (= chorusrun),
``chorus analyze DIR`` (flight recorder dumps), ``chorus trace merge PREFIX`` and
``chorus explain COLLECTIVE``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        from chorus.launch.cli import main as run_main

        return run_main(argv[1:])
    if argv[:1] == ["config"]:
        from chorus.config import main as config_main

        return config_main(argv[1:])
    if argv[:1] == ["analyze"]:
        from chorus.debug.analyze import main as analyze_main

        return analyze_main(argv[1:])
    if argv[:1] == ["trace"]:
        from chorus.trace import main as trace_main

        return trace_main(argv[1:])
    if argv[:1] == ["explain"]:
        from chorus.explain.cli import main as explain_main

        return explain_main(argv[1:])
    if argv[:1] == ["bench-ddp"] or argv[:2] == ["bench", "--ddp"]:
        from chorus.bench.ddp import main as ddp_main

        return ddp_main(argv[1 if argv[0] == "bench-ddp" else 2:])
    p = argparse.ArgumentParser(prog="chorus", description="chorus command-line tools")
    sub = p.add_subparsers(dest="command", required=True)
    from chorus.bench import cli as bench

    bench.add_arguments(sub.add_parser(
        "bench", help="time collectives against torch gloo and MPI", description=bench.__doc__,
        formatter_class=bench.HelpFormatter))
    sub.add_parser("run", help="launch ranks (same as chorusrun)")
    sub.add_parser("config", help="print every CHORUS_* setting: its value, whether it is set, its meaning")
    sub.add_parser("bench-ddp", help="time a DDP training step on chorus against gloo (also: bench --ddp)")
    sub.add_parser("analyze", help="read the flight recorder dumps of a failed or hung job: who was "
                                   "behind on which op, mismatched calls, ranks without a dump")
    sub.add_parser("trace", help="merge the ranks' CHORUS_TRACE files into one timeline (trace merge)")
    sub.add_parser("explain", help="show an algorithm's schedule step by step (terminal table, --html "
                                   "animation), or replay a trace")
    args = p.parse_args(argv)
    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
