"""A walkthrough as terminal text: per step, who sends which block to whom, then a table
of what every rank holds."""

from __future__ import annotations

from chorus.explain.walk import Action, Walkthrough, letter

ARROW = {"send": "->", "recv": "<-"}


def size(nbytes: int) -> str:
    """``512 B``, ``4 KiB``, ``1.5 MiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"


def _short(a: Action) -> str:
    """``data[3]=a -> 1 (4 B)``, ``data[2]+=d <- 3``, ``scratch[0]=data[0]``."""
    if a.kind == "send":
        return f"{a.region}={a.content} -> {a.peer} ({size(a.nbytes)})"
    if a.kind == "recv":
        return f"{a.region}{'+=' if 'reduces' in a.text else '='}{a.content} <- {a.peer}"
    if a.kind in ("copy", "reduce") and not a.arrows and a.peer < 0 and " into " in a.text:
        src = a.text.split(" copies " if a.kind == "copy" else " reduces ")[1].split(" into ")[0]
        return f"{a.region}{'+=' if a.kind == 'reduce' else '='}{src}"
    return a.text.split(": ", 1)[-1]


def table(walk: Walkthrough, state, indent: str = "  ") -> list[str]:
    """Rows: ranks; columns: the cells of every buffer (``data[0]`` ...); then the window,
    one row per buffer (its slots)."""
    ranks = [(h, holder) for h, holder in zip(walk.holders, state, strict=True) if h != "window"]
    buffers: list[str] = []
    for _, holder in ranks:
        for name in holder:
            if name not in buffers:
                buffers.append(name)
    grids = []
    for name in buffers:
        width = max(len(holder.get(name, ())) for _, holder in ranks)
        head = ["", *(f"{name}[{i}]" if width > 1 else name for i in range(width))]
        rows = [[h, *(cell[0] for cell in holder[name])] for h, holder in ranks if name in holder]
        grids.append([head, *rows])
    window = next((holder for h, holder in zip(walk.holders, state, strict=True) if h == "window"), None)
    if window:
        width = max(len(cells) for cells in window.values())
        grids.append([["window", *(f"[{i}]" for i in range(width))],
                      *([name, *(cell[0] for cell in cells)] for name, cells in window.items())])
    lines = []
    for grid in grids:
        n = max(len(r) for r in grid)
        grid = [r + [""] * (n - len(r)) for r in grid]
        widths = [max(len(r[i]) for r in grid) for i in range(n)]
        lines += [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in grid]
    return lines


def render(walk: Walkthrough, doc: bool = True) -> str:
    """The whole walkthrough as text."""
    W = walk.world
    names = ", ".join(letter(r) for r in range(min(W, 8))) + (", ..." if W > 8 else "")
    what = "reductions" if walk.collective in ("all_reduce", "reduce", "reduce_scatter", "barrier") else "blocks"
    out = [f"{walk.collective}, algorithm {walk.algorithm}, {W} ranks, {walk.count} element(s) of "
           f"{walk.itemsize} bytes per rank" + (f", root {walk.root}" if walk.collective in
                                                ("broadcast", "reduce", "gather", "scatter") else "")]
    if what == "reductions":
        out.append(f"ranks are {names}; a cell shows whose inputs it holds (a+b: ranks 0 and 1, "
                   "Σ: every rank's, ·: nothing yet; *: part of the cell)")
    else:
        out.append(f"ranks are {names}; a cell shows where its data came from (b: rank 1's input, "
                   "b2: block 2 of it, ·: nothing yet; *: part of the cell)")
    if doc and walk.doc:
        out += ["", *("    " + line if line else "" for line in walk.doc.splitlines())]
    out += ["", "before"]
    out += table(walk, walk.initial)
    for i, step in enumerate(walk.steps):
        out += ["", f"{step.title} ({i + 1}/{len(walk.steps)})" + (f"  {step.note}" if step.note else "")]
        if walk.kind == "schedule":
            by_rank: dict[int, list[str]] = {}
            for a in step.actions:
                by_rank.setdefault(a.holder, []).append(_short(a))
            for r in sorted(by_rank):
                out.append(f"  rank {r}: " + "   ".join(by_rank[r]))
        else:
            out += [f"  {a.text}" for a in step.actions if a.kind != "sync"]
            if any(a.kind == "sync" for a in step.actions):
                out.append("  every rank raises its counter in the window and waits until every other's is as high")
        if step.actions and all(a.kind == "sync" for a in step.actions):
            continue
        out += table(walk, step.state)
    if walk.footer:
        out += ["", *walk.footer]
    return "\n".join(out) + "\n"
