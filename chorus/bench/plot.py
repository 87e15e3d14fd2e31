"""``--plot FILE.png``: busbw against size (log-log) per library, and chorus's speed-up
over each baseline against size.  Needs matplotlib (the ``plot`` extra); draws with the
Agg canvas, never through pyplot's global state or a display."""

from __future__ import annotations

from chorus.bench.report import Row, libraries, speedups
from chorus.bench.sizes import human


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_plot(rows: list[Row], path: str, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    libs = libraries(rows)
    baselines = [lib for lib in libs if lib != "chorus"]
    fig = Figure(figsize=(12, 4.8))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    sized = [r for r in rows if r.nbytes > 0 and r.collective != "barrier"]
    if sized:
        for lib in libs:
            points = sorted((r.nbytes, r.busbw) for r in sized if r.library == lib and r.busbw > 0)
            if points:
                left.plot(*zip(*points, strict=True), marker="o", label=lib)
        left.set_xscale("log", base=2)
        left.set_yscale("log")
        left.set_ylabel("busbw (GB/s)")
        left.set_title("bus bandwidth")
        for lib in baselines:
            points = sorted(speedups(sized, lib).items())
            if points:
                right.plot(*zip(*points, strict=True), marker="o", label=f"chorus vs {lib}")
        right.set_xscale("log", base=2)
        right.set_yscale("log")
        right.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}x"))
        right.yaxis.set_minor_formatter(FuncFormatter(lambda y, _pos: f"{y:g}x"))
        for ax in (left, right):
            ax.set_xlabel("message size (bytes)")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: human(int(x)) if x >= 1 else ""))
    else:  # barrier: one bar per library
        left.bar(libs, [next(r.seconds * 1e6 for r in rows if r.library == lib) for lib in libs])
        left.set_ylabel("time per barrier (us)")
        left.set_title("latency")
        ratios = [speedups(rows, lib).get(0, 0.0) for lib in baselines]
        right.bar([f"vs {lib}" for lib in baselines], ratios)
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    right.set_ylabel("chorus speed-up (baseline time / chorus time)")
    right.set_title("chorus speed-up" if baselines else "chorus speed-up (no baseline ran)")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
