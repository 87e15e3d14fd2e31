"""``chorus explain``: an algorithm's steps in the terminal, or as an animated page.

    chorus explain all_reduce --world 4 --algorithm ring            # steps and tables
    chorus explain all_reduce --world 4 --algorithm ring --html ring.html
    chorus explain all_gather --world 5 --algorithm bruck --bytes 40
    chorus explain all_reduce --world 4 --algorithm shm:rs_ag         # shared memory, as phases
    chorus explain --list                                            # every algorithm
    chorus explain --trace job.json [--op 5]                          # a traced run, replayed
"""

from __future__ import annotations

import argparse
import sys

from chorus.explain.html import render_html
from chorus.explain.shm import ALGORITHMS as SHM_ALGORITHMS
from chorus.explain.shm import shm_walk
from chorus.explain.text import render
from chorus.explain.walk import count_for, schedule_walk
from chorus.schedules.registry import ALGORITHMS
from chorus.selection import default_algorithm

MAX_WORLD = 62  # contents are bit masks of ranks


def algorithms(collective: str) -> list[str]:
    """Every algorithm ``chorus explain`` shows for ``collective``: the schedules, then the
    shared-memory ones."""
    return [*ALGORITHMS.get(collective, {}), *SHM_ALGORITHMS.get(collective, ())]


def walkthrough(collective: str, world: int, algorithm: str | None = None, nbytes: int | None = None,
                root: int = 0, itemsize: int = 4):
    """The walkthrough ``chorus explain`` shows (ValueError for bad arguments)."""
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}; valid: {', '.join(ALGORITHMS)}")
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"--world {world}: chorus explain draws 1 to {MAX_WORLD} ranks")
    if not 0 <= root < world:
        raise ValueError(f"--root {root} is not a rank of {world}")
    count = count_for(collective, world, world * itemsize if nbytes is None else nbytes, itemsize)
    if collective == "barrier":
        count = 0
    if algorithm is None:
        algorithm = default_algorithm(collective, world, count * itemsize)
    if algorithm not in algorithms(collective):
        raise ValueError(f"unknown {collective} algorithm {algorithm!r}; valid: {', '.join(algorithms(collective))}")
    if algorithm.startswith("shm:"):
        return shm_walk(collective, algorithm, world, count, root=root, itemsize=itemsize)
    return schedule_walk(collective, algorithm, world, count, root=root, itemsize=itemsize)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="chorus explain", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Show a collective's algorithm step by step: who sends which block to whom and what "
                    "every rank holds after each step (the real schedules, run through chorus.sim), or "
                    "replay a traced run.", epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("collective", nargs="?", help=", ".join(ALGORITHMS))
    p.add_argument("--world", "-w", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--algorithm", "-a", help="an algorithm of the collective (--list); default: the one "
                                             "chorus picks over TCP for this size")
    p.add_argument("--bytes", "-b", type=int, help="message size as nccl-tests counts it (all_reduce: the "
                                                   "data; all_gather: the whole output; ...); default: one "
                                                   "float32 per cell")
    p.add_argument("--root", type=int, default=0, help="root of broadcast, reduce, gather, scatter")
    p.add_argument("--html", metavar="FILE", help="also write a self-contained page that animates the steps")
    p.add_argument("--no-doc", action="store_true", help="leave out the algorithm's docstring")
    p.add_argument("--list", action="store_true", help="list every collective's algorithms")
    p.add_argument("--trace", metavar="JOB_JSON", help="replay an op of a trace (CHORUS_TRACE file, or "
                                                       "chorus trace merge's)")
    p.add_argument("--op", type=int, help="with --trace: the op's sequence number (default: the first "
                                          "one with transfers)")
    p.add_argument("--group", type=int, default=0, help="with --trace: the group id (default 0, WORLD)")
    args = p.parse_args(argv)
    if args.list:
        for collective in ALGORITHMS:
            print(f"{collective:<15} {', '.join(algorithms(collective))}")
        return 0
    try:
        if args.trace:
            from chorus.explain.replay import replay

            walk, listing = replay(args.trace, args.op, args.group)
            print("ops in the trace:")
            print("\n".join(f"  {line}" for line in listing))
            print()
        elif args.collective:
            walk = walkthrough(args.collective, args.world, args.algorithm, args.bytes, args.root)
        else:
            p.error("name a collective, or pass --trace or --list")
    except (ValueError, OSError) as exc:
        print(f"chorus explain: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(walk, doc=not args.no_doc))
    if args.html:
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(render_html(walk))
        print(f"\nwrote {args.html}: open it in a browser (no network needed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
