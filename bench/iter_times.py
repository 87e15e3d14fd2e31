"""Per-op times of one collective, chorus and torch gloo, in the harness of ``chorus bench``
(reset the input, barrier, time one op), to see what a mean hides: rank 0 prints the
mean, median, 10th and 90th percentile and maximum per library, size and variant.

usage: python3 bench/iter_times.py W OUTDIR COLLECTIVE SIZES_MIB ITERS [VARIANTS]
  e.g. python3 bench/iter_times.py 8 /tmp/it all_to_all 4,16,64 60 reset,keep

Variants: ``reset`` rewrites the input before each op, ``check`` also checks each op's
result afterwards with ``chorus bench``'s check (as the bench does), ``keep`` leaves the
input as the op before left it.  Each size runs chorus then gloo, ITERS ops each, as
the bench does; with 2+ variants they alternate size by size.  Also prints the host's
transparent-huge-page mode and how much of each rank-0 buffer huge pages back.
Writes OUTDIR/iter_times.json.  Needs torch.  Results are not checked (chorus bench does).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
from ranks import spawn

from chorus.bench.ops import make_buffers


def _huge_kib(arr: np.ndarray) -> int:
    """KiB of huge pages backing the mappings that hold ``arr`` (from /proc/self/smaps)."""
    lo = arr.__array_interface__["data"][0]
    hi, total, inside = lo + arr.nbytes, 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    a, b = (int(x, 16) for x in head.split("-"))
                    inside = a < hi and b > lo
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1])
    except OSError:
        return -1
    return total


def _step(api, collective: str, inp, out):
    if collective == "all_to_all":
        api.all_to_all_single(out, inp)
    elif collective == "all_reduce":
        api.all_reduce(inp)
    else:
        raise SystemExit(f"unknown collective {collective!r}")


def rank_main(rank: int, world: int, collective: str, sizes: list[int], iters: int, variants: list[str],
              outdir: str) -> None:
    import warnings

    import torch
    import torch.distributed as tdist

    import chorus

    warnings.filterwarnings("ignore", category=FutureWarning)
    chorus.init_process_group("chorus", init_method=f"file://{outdir}/chorus.rdzv", rank=rank, world_size=world)
    tdist.init_process_group("gloo", init_method=f"file://{outdir}/gloo.rdzv", rank=rank, world_size=world)
    rows = []
    for nbytes in sizes:
        n = nbytes // 4 // world * world
        for variant in variants:
            for lib, api in (("chorus", chorus), ("gloo", tdist)):
                bufs = make_buffers(collective, n, "float32", rank, world) if variant == "check" else None
                template = np.arange(n, dtype=np.float32) + rank if bufs is None else bufs.template
                inp, out = (template.copy(), np.zeros(n, np.float32)) if bufs is None else (bufs.inp, bufs.out)
                args = (inp, out) if lib == "chorus" else (torch.from_numpy(inp), torch.from_numpy(out))
                for _ in range(3):
                    inp[...] = template
                    _step(api, collective, *args)
                times, wrong = [], 0
                for _ in range(iters):
                    if variant != "keep":
                        inp[...] = template
                    api.barrier()
                    start = time.perf_counter()
                    _step(api, collective, *args)
                    times.append(time.perf_counter() - start)
                    if bufs is not None:
                        wrong += bufs.check()
                api.barrier()
                ms = sorted(t * 1e3 for t in times)
                row = {"lib": lib, "variant": variant, "nbytes": nbytes, "mean": statistics.mean(ms),
                       "median": statistics.median(ms), "p10": ms[len(ms) // 10], "p90": ms[len(ms) * 9 // 10],
                       "max": ms[-1], "huge_kib_in": _huge_kib(inp), "huge_kib_out": _huge_kib(out), "wrong": wrong, "ms": ms}
                rows.append(row)
                if rank == 0:
                    print(f"{collective} {nbytes >> 20:4d}M {variant:6s} {lib:6s} mean {row['mean']:7.3f} "
                          f"median {row['median']:7.3f} p10 {row['p10']:7.3f} p90 {row['p90']:7.3f} "
                          f"max {row['max']:7.3f}  huge KiB in/out {row['huge_kib_in']}/{row['huge_kib_out']}",
                          flush=True)
    if rank == 0:
        with open(os.path.join(outdir, "iter_times.json"), "w") as f:
            json.dump(rows, f)
    chorus.destroy_process_group()
    tdist.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) not in (5, 6):
        print(__doc__, file=sys.stderr)
        return 2
    world, outdir, collective = int(argv[0]), argv[1], argv[2]
    sizes = [int(float(x) * (1 << 20)) for x in argv[3].split(",")]
    iters = int(argv[4])
    variants = (argv[5] if len(argv) == 6 else "reset").split(",")
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            print("transparent_hugepage:", f.read().strip(), flush=True)
    except OSError:
        pass
    return spawn(rank_main, world, outdir, collective, sizes, iters, variants, outdir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
