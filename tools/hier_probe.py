"""Where a hierarchical all_reduce's time goes, on two simulated hosts of two ranks
(``CHORUS_HOST_ID=a,a,b,b``, four processes on this machine), float32:

    python3 tools/hier_probe.py phases SIZE ITERS [two_phase]
        the library's all_reduce of SIZE bytes against its phases run alone on the
        hierarchy's sub-groups (reduce_scatter in the host, all_reduce in the column,
        all_gather in the host), microseconds per call on each rank; ``two_phase``: the
        library's all_reduce with every size on the two-phase path (an all_reduce in the
        host, then one of the whole buffer in the column: ``COLUMN_BYTES`` raised)

    python3 tools/hier_probe.py insitu SIZES ITERS
        the library's all_reduce of each size, with the time each of its phases took
        inside it (and the rest: the op's own work around them) summed over the calls,
        microseconds per call on each rank

    python3 tools/hier_probe.py pipeline SIZES ITERS PIECES
        the same three phases pipelined by hand over P pieces of the buffer (the column's
        all_reduce of piece i async, while the host's reduce_scatter of piece i + 1 and
        all_gather of piece i - 1 run), for each P in PIECES (comma-separated, as SIZES),
        against the library (best of two rounds)
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from chorus.testing import run_processes


def _timed(f, iters: int) -> float:
    import chorus as dist

    for _ in range(3):
        f()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    return (time.perf_counter() - t0) / iters * 1e6


def phases(rank: int, world: int, nbytes: int, iters: int, two_phase: bool) -> tuple:
    import chorus as dist
    from chorus.api.state import current

    if two_phase:
        import chorus.components.hierarchy as hierarchy

        hierarchy.COLUMN_BYTES = 1 << 40
    h = current().default_group.hierarchy
    x = np.ones(nbytes // 4, np.float32)
    chunk = np.empty(x.size // h.local.size(), np.float32)
    whole = _timed(lambda: dist.all_reduce(x), iters)
    parts = {"reduce_scatter in host": lambda: dist.reduce_scatter_tensor(chunk, x, group=h.local),
             "all_reduce in column": lambda: dist.all_reduce(chunk, group=h.column),
             "all_gather in host": lambda: dist.all_gather_into_tensor(x, chunk, group=h.local)}
    return whole, {name: round(_timed(f, iters)) for name, f in parts.items()}


def insitu(rank: int, world: int, sizes: list, iters: int) -> list:
    import chorus as dist
    import chorus.components.hierarchy as hierarchy

    spent: dict = {}
    inner = hierarchy.Phases.phase

    def timed_phase(self, group, name, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(self, group, name, *args, **kwargs)
        finally:
            where = "host" if group is self.local else "column" if group is self.h.column else "leaders"
            key = f"{name} in {where}"
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0

    hierarchy.Phases.phase = timed_phase
    out = []
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        whole = (time.perf_counter() - t0) / iters * 1e6
        parts = {k: round(v / iters * 1e6) for k, v in spent.items()}
        parts["rest"] = round(whole - sum(parts.values()))
        out.append((nbytes, round(whole), parts))
    return out


def pipeline(rank: int, world: int, sizes: list, iters: int, pieces: list) -> list:
    import chorus as dist
    from chorus.api.state import current

    h = current().default_group.hierarchy
    local, column, size = h.local, h.column, h.local.size()
    out = []
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        variants = [("library", lambda x=x: dist.all_reduce(x))]
        variants += [(f"P={p}", _pipelined(x, p, local, column, size)) for p in pieces]
        best: dict = {}
        for _ in range(2):
            for name, f in variants:
                best[name] = min(best.get(name, float("inf")), _timed(f, iters))
        out.append((nbytes, {k: round(v) for k, v in best.items()}))
    return out


def _pipelined(x: np.ndarray, p: int, local, column, size: int):
    """The three phases of ``x``'s all_reduce over ``p`` pieces, the column's part async."""
    import chorus as dist

    rows = x.size // size
    b = [size * (rows * i // p) for i in range(p + 1)]
    chunks = [np.empty((b[i + 1] - b[i]) // size, np.float32) for i in range(p)]

    def run() -> None:
        pending = []
        for i in range(p):
            dist.reduce_scatter_tensor(chunks[i], x[b[i]:b[i + 1]], group=local)
            pending.append(dist.all_reduce(chunks[i], group=column, async_op=True))
            if i:
                pending[i - 1].wait()
                dist.all_gather_into_tensor(x[b[i - 1]:b[i]], chunks[i - 1], group=local)
        pending[-1].wait()
        dist.all_gather_into_tensor(x[b[p - 1]:b[p]], chunks[p - 1], group=local)
    return run


def main(argv: list[str]) -> None:
    os.environ["CHORUS_HOST_ID"] = "a,a,b,b"
    if argv[:1] == ["phases"]:
        nbytes, iters, two = int(argv[1]), int(argv[2]), argv[3:] == ["two_phase"]
        for rank, (whole, parts) in enumerate(run_processes(phases, 4, nbytes, iters, two)):
            print(f"{'two_phase' if two else 'columns'} {nbytes} B, rank {rank}: all_reduce {whole:.0f} us; {parts}")
    elif argv[:1] == ["insitu"]:
        sizes, iters = [int(s) for s in argv[1].split(",")], int(argv[2])
        for rank, rows in enumerate(run_processes(insitu, 4, sizes, iters)):
            for nbytes, whole, parts in rows:
                print(f"{nbytes} B, rank {rank}: all_reduce {whole} us; {parts}")
    elif argv[:1] == ["pipeline"]:
        sizes, iters, pieces = [int(s) for s in argv[1].split(",")], int(argv[2]), [int(p) for p in argv[3].split(",")]
        for nbytes, times in run_processes(pipeline, 4, sizes, iters, pieces)[0]:
            print(f"{nbytes} B: {times}")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
