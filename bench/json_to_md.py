"""Markdown tables from `chorus bench --json` files: python3 bench/json_to_md.py FILE..."""

import json
import sys


def human(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def table(path: str) -> str:
    d = json.load(open(path))
    by: dict[int, dict] = {}
    for r in d["rows"]:
        by.setdefault(r["nbytes"], {})[r["library"]] = r
    libs = [lib for lib in ("gloo", "mpi") if any(lib in e for e in by.values())]
    head = "| size | chorus us | " + " | ".join(f"{lib} us" for lib in libs) + " | " + \
        " | ".join(f"x vs {lib}" for lib in libs) + " | #wrong |"
    lines = [f"**{d['collective']}, W = {d['world']}** ({d['dtype']}, op {d['op']})", "", head,
             "|" + "---|" * (3 + 2 * len(libs))]
    for size in sorted(by):
        e = by[size]
        c = e["chorus"]["us"]
        times = [f"{e[lib]['us']:.1f}" if lib in e else "-" for lib in libs]
        ratios = [f"{e[lib]['us'] / c:.2f}x" if lib in e else "-" for lib in libs]
        wrong = sum(r["wrong"] for r in e.values())
        lines.append(f"| {human(size)} | {c:.1f} | " + " | ".join(times) + " | " + " | ".join(ratios) + f" | {wrong} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print("\n".join(table(p) for p in sys.argv[1:]))
