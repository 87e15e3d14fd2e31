"""Compare chorus's times in two sets of ``chorus bench --json`` files, size by size: two
settings (``CHORUS_FLIGHT_RECORDER_SIZE=0`` and the default, say) or two chorus versions.

    python3 tools/bench_compare.py --before a1.json a2.json --after b1.json b2.json

Each side may hold several runs of the same sweep; run the two sides alternately, one run
after another, so that both meet the same machine state.  Per size the table shows each
side's runs, the better of each side, and after/before of the better ones (below 1.00:
after is faster).  ``--limit 1.10`` exits 1 when some size's ratio is above it.
"""

from __future__ import annotations

import argparse
import json
import sys


def chorus_times(path: str) -> tuple[str, dict[int, float]]:
    """(collective, {bytes: seconds per op}) of chorus's rows in one result file."""
    with open(path) as f:
        doc = json.load(f)
    rows = {r["nbytes"]: r["seconds"] for r in doc["rows"] if r["library"] == "chorus"}
    return doc["collective"], rows


def human(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", nargs="+", required=True, help="result files of the reference setting or version")
    parser.add_argument("--after", nargs="+", required=True, help="result files of the setting or version compared with it")
    parser.add_argument("--limit", type=float, default=None, help="fail when after/before exceeds this")
    args = parser.parse_args(argv)
    before = [chorus_times(p) for p in args.before]
    after = [chorus_times(p) for p in args.after]
    names = {c for c, _ in before + after}
    if len(names) != 1:
        parser.error(f"the files hold different collectives: {sorted(names)}")
    sizes = sorted(set.intersection(*(set(t) for _, t in before + after)))
    print(f"{names.pop()}: us per op (chorus), before runs | after runs | best after / best before")
    worst = 0.0
    for n in sizes:
        b = [t[n] * 1e6 for _, t in before]
        a = [t[n] * 1e6 for _, t in after]
        ratio = min(a) / min(b)
        worst = max(worst, ratio)
        print(f"{human(n):>6}  {' '.join(f'{x:9.1f}' for x in b)} | {' '.join(f'{x:9.1f}' for x in a)}"
              f" | {ratio:5.2f}")
    print(f"worst ratio {worst:.2f}")
    return 1 if args.limit is not None and worst > args.limit else 0


if __name__ == "__main__":
    sys.exit(main())
