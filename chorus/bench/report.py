"""The result table: nccl-tests columns for each library, plus chorus's speed-up."""

from __future__ import annotations

from dataclasses import dataclass

from chorus.bench.sizes import human

#: busbw = algbw * factor(W), as nccl-tests defines it.
BUS_FACTOR = {
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "all_to_all": lambda w: (w - 1) / w,
    "broadcast": lambda w: 1.0,
    "reduce": lambda w: 1.0,
    "sendrecv": lambda w: 1.0,
    "barrier": lambda w: 0.0,
}


@dataclass
class Row:
    library: str
    collective: str
    nbytes: int
    count: int
    dtype: str
    op: str
    seconds: float  # per iteration, slowest rank
    wrong: int
    world: int

    @property
    def algbw(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def busbw(self) -> float:
        return self.algbw * BUS_FACTOR[self.collective](self.world)


def format_table(rows: list[Row], baseline: str = "gloo") -> str:
    """One line per size: chorus's columns, then each other library's time and the ratio."""
    libs = sorted({r.library for r in rows}, key=lambda name: (name != "chorus", name))
    by = {(r.library, r.nbytes): r for r in rows}
    sizes = sorted({r.nbytes for r in rows})
    head = f"{'size':>8} {'count':>10} {'dtype':>8} {'op':>5}"
    for lib in libs:
        head += f" | {lib + ' us':>12} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
    others = [lib for lib in libs if lib != "chorus"]
    for lib in others:
        head += f" | {'x vs ' + lib:>9}"
    lines = [head, "-" * len(head)]
    for size in sizes:
        first = next(by[(lib, size)] for lib in libs if (lib, size) in by)
        line = f"{human(size):>8} {first.count:>10} {first.dtype:>8} {first.op:>5}"
        for lib in libs:
            r = by.get((lib, size))
            line += (f" | {r.seconds * 1e6:>12.1f} {r.algbw:>7.2f} {r.busbw:>7.2f} {r.wrong:>6}" if r
                     else f" | {'-':>12} {'-':>7} {'-':>7} {'-':>6}")
        for lib in others:
            c, o = by.get(("chorus", size)), by.get((lib, size))
            line += f" | {o.seconds / c.seconds:>8.2f}x" if c and o and c.seconds else f" | {'-':>9}"
        lines.append(line)
    return "\n".join(lines)
