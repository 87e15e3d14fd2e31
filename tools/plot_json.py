"""Draw ``chorus bench --plot``'s figure from a ``--json`` file written earlier (e.g. one
of docs/results/): busbw per library and chorus's speed-up, against size.  Needs matplotlib.

usage: python3 tools/plot_json.py RESULT.json OUT.png [TITLE]
"""

from __future__ import annotations

import dataclasses
import json
import sys

from chorus.bench.plot import write_plot
from chorus.bench.report import Row

FIELDS = [f.name for f in dataclasses.fields(Row)]


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        result = json.load(f)
    rows = [Row(**{k: r[k] for k in FIELDS}) for r in result["rows"]]
    title = argv[2] if len(argv) == 3 else (
        f"{result['collective']}, {result['world']} ranks, {result['dtype']}, transport {result['transport']}")
    write_plot(rows, argv[1], title)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
