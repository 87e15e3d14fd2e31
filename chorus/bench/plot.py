"""``--plot FILE.png``: busbw against size (log-log) per library, and chorus's speed-up
over each baseline against size.  Needs matplotlib (the ``plot`` extra); draws with the
Agg canvas, never through pyplot's global state or a display.

Tick labels never crowd each other: sizes are labelled at powers of two spaced so that
at most MAX_SIZE_TICKS carry a label, and speed-ups at 1, 2 and 5 times the powers of
ten, without labels on the minor ticks between them."""

from __future__ import annotations

import math

from chorus.bench.report import Row, libraries, speedups
from chorus.bench.sizes import human

MAX_SIZE_TICKS = 8


def size_ticks(sizes: list[int]) -> list[int]:
    """Powers of two from the smallest to the largest of ``sizes`` (> 0), every k-th one
    (k a power of two, as small as keeps them at most MAX_SIZE_TICKS): 16, 256, 4K, ..."""
    low, high = math.floor(math.log2(min(sizes))), math.ceil(math.log2(max(sizes)))
    stride = 1
    while (high - low) // stride + 1 > MAX_SIZE_TICKS:
        stride *= 2
    first = -(-low // stride) * stride
    return [1 << e for e in range(first, high + 1, stride)]


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_plot(rows: list[Row], path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    libs = libraries(rows)
    baselines = [lib for lib in libs if lib != "chorus"]
    fig = Figure(figsize=(12, 4.8))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    sized = [r for r in rows if r.nbytes > 0 and r.collective != "barrier"]
    if sized:
        bandwidths, ratios = [], [1.0]
        for lib in libs:
            points = sorted((r.nbytes, r.busbw) for r in sized if r.library == lib and r.busbw > 0)
            if points:
                left.plot(*zip(*points, strict=True), marker="o", label=lib)
                bandwidths += [bw for _, bw in points]
        left.set_ylabel("busbw (GB/s)")
        left.set_title("bus bandwidth")
        for lib in baselines:
            points = sorted(speedups(sized, lib).items())
            if points:
                right.plot(*zip(*points, strict=True), marker="o", label=f"chorus vs {lib}")
                ratios += [x for _, x in points]
        ticks = size_ticks([r.nbytes for r in sized])
        for ax, values, suffix in ((left, bandwidths, ""), (right, ratios, "x")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message size (bytes)")
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: human(int(x)) if x >= 1 else ""))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_yscale("log")
            if values:
                _label_log_axis(ax.yaxis, min(values), max(values), suffix)
    else:  # barrier: one bar per library
        bars = left.bar(libs, [next(r.seconds * 1e6 for r in rows if r.library == lib) for lib in libs])
        left.bar_label(bars, fmt="%.1f us")
        left.set_ylabel("time per barrier (us)")
        left.set_title("latency")
        bars = right.bar([f"vs {lib}" for lib in baselines], [speedups(rows, lib).get(0, 0.0) for lib in baselines])
        right.bar_label(bars, fmt="%.2fx")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    right.set_ylabel("chorus speed-up (baseline time / chorus time)")
    right.set_title("chorus speed-up (above 1x: chorus is faster)" if baselines
                    else "chorus speed-up (no baseline ran)")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _label_log_axis(axis, low: float, high: float, suffix: str) -> None:
    """Plain-number labels ("0.01", "20x") on a log axis holding ``low`` .. ``high``: at
    the powers of ten over more than three decades, at 1, 2 and 5 times them over one to
    three, else at evenly spaced round values (a log locator would label one tick or
    none); none on the minor ticks."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    if high > 1000 * low:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0,)))
    elif high >= 10 * low:
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    else:
        axis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    axis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}{suffix}"))
    axis.set_minor_formatter(NullFormatter())
