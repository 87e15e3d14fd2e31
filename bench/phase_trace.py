"""Where one shared-memory collective's time goes, phase by phase, on every rank: the
work before each sync, the wait inside it, and the work after the last, in ``chorus
bench``'s harness (reset, barrier, one timed op, check).

usage: python3 bench/phase_trace.py W OUTDIR COLLECTIVE MIB ITERS
  e.g. python3 bench/phase_trace.py 8 /tmp/pt all_to_all 1 200

Rank 0 prints the op's median, p10 and p90 (us) and, per rank, the median of each
segment ("w" work, "s" wait in a sync) over the ops.  The latency paths (small
all_reduce, all_to_all in one round) sync without ``Sync.sync``: their ops show one
segment.  Every rank's clock is
``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every process of a host).
Writes OUTDIR/phase_trace.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from iter_times import _step  # all_to_all or all_reduce, as iter_times times them
from ranks import spawn

from chorus.bench.ops import make_buffers


def rank_main(rank: int, world: int, collective: str, mib: float, iters: int, outdir: str) -> None:
    import chorus
    from chorus.shm import sync as shm_sync

    chorus.init_process_group("chorus", init_method=f"file://{outdir}/chorus.rdzv", rank=rank, world_size=world)
    marks: list[tuple[float, float]] = []
    plain = shm_sync.Sync.sync

    def timed(self, ctx, first=False):
        entered = time.perf_counter()
        try:
            return plain(self, ctx, first=first)
        finally:
            marks.append((entered, time.perf_counter()))

    n = int(mib * (1 << 20)) // 4 // world * world
    bufs = make_buffers(collective, n, "float32", rank, world)
    ops = []
    for i in range(iters + 5):
        bufs.reset()
        chorus.barrier()
        shm_sync.Sync.sync = timed
        marks.clear()
        start = time.perf_counter()
        _step(chorus, collective, bufs.inp, bufs.out)
        end = time.perf_counter()
        shm_sync.Sync.sync = plain
        if i >= 5:
            ops.append((start, end, list(marks)))
        bufs.check()
    with open(os.path.join(outdir, f"trace-{rank}.json"), "w") as f:
        json.dump(ops, f)
    chorus.barrier()
    if rank == 0:
        _report(world, outdir)
    chorus.destroy_process_group()


def _segments(start: float, end: float, marks: list) -> list[float]:
    out, prev = [], start
    for entered, left in marks:
        out += [entered - prev, left - entered]
        prev = left
    return [*out, end - prev]


def _report(world: int, outdir: str) -> None:
    traces = []
    for r in range(world):
        with open(os.path.join(outdir, f"trace-{r}.json")) as f:
            traces.append(json.load(f))
    total = sorted((e - s) * 1e6 for s, e, _ in traces[0])
    print(f"op on rank 0 (us): median {statistics.median(total):.0f} p10 {total[len(total) // 10]:.0f} "
          f"p90 {total[len(total) * 9 // 10]:.0f}")
    rows = {}
    for r, ops in enumerate(traces):
        segs = [_segments(*op) for op in ops]
        width = max(len(s) for s in segs)
        segs = [s for s in segs if len(s) == width]
        med = [statistics.median(s[k] for s in segs) * 1e6 for k in range(width)]
        late = statistics.median((ops[i][0] - min(t[i][0] for t in traces)) * 1e6 for i in range(len(ops)))
        rows[r] = {"late_start_us": late, "segments_us": med}
        print(f"rank {r}: starts {late:4.0f} late | " + " ".join(
            f"{'w' if k % 2 == 0 else 's'} {x:4.0f}" for k, x in enumerate(med)))
    with open(os.path.join(outdir, "phase_trace.json"), "w") as f:
        json.dump({"op_us": total, "ranks": rows}, f)


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    world, outdir, collective, mib, iters = int(argv[0]), argv[1], argv[2], float(argv[3]), int(argv[4])
    return spawn(rank_main, world, outdir, collective, mib, iters, outdir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
