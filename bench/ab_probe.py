"""Paired comparison behind chorus.shm.direct.MEASURED and chorus.shm.crew: for each
collective and size, chorus's variants and torch gloo run op by op in turn, in the same W
processes, each op after its library's barrier, their order rotating round by round;
rank 0 prints the median, minimum and mean
time per variant (ms) and gloo's median over each chorus variant's.  Variants:

    copy    the copy path, helper threads from phases.COPY_PATH_CREW_BYTES (all_reduce:
            reduce-scatter + all-gather over slices)
    copyc   the copy path, helper threads at every size
    copy1   the copy path, no helper threads
    whole   all_reduce only: every rank reduces every chunk whole (WHOLE_CHUNKS_WORLD)
    cma     single copy (process_vm_readv), helper threads where they apply
    reg     default settings on registered buffers (chorus.empty_shared: chorus.shm.mapped)
    reg1    the same without helper threads

usage: python3 bench/ab_probe.py W OUTDIR ROUNDS COLLECTIVES SIZES_MIB
  e.g. python3 bench/ab_probe.py 8 /tmp/ab 5 all_reduce,broadcast 1,4,16,64,256
  (AB_VARIANTS=copy,reg,gloo: only those variants)

Needs torch.  Writes OUTDIR/ab.json.  Results are not checked here (chorus bench checks
every op); this only times.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
from ranks import spawn

INF = float("inf")
VARIANTS = ("copy", "copyc", "copy1", "whole", "cma", "reg", "reg1", "gloo")


def _step(api, collective: str, data, out, block, small):
    """One collective through ``api`` (chorus or torch.distributed)."""
    if collective == "all_reduce":
        api.all_reduce(data)
    elif collective == "broadcast":
        api.broadcast(data, src=0)
    elif collective == "all_gather":
        api.all_gather_into_tensor(out, small)
    elif collective == "all_to_all":
        api.all_to_all_single(out, data)
    elif collective == "reduce_scatter":
        api.reduce_scatter_tensor(out[:block], data)
    else:
        raise SystemExit(f"unknown collective {collective!r}")


def rank_main(rank: int, world: int, sizes: list[int], collectives: list[str], rounds: int, outdir: str) -> None:
    import warnings

    import torch
    import torch.distributed as tdist

    import chorus

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13's *_tensor names
    from chorus.shm import collectives as shm_collectives
    from chorus.shm import crew, direct, phases

    chorus.init_process_group("chorus", init_method=f"file://{outdir}/chorus.rdzv", rank=rank, world_size=world)
    tdist.init_process_group("gloo", init_method=f"file://{outdir}/gloo.rdzv", rank=rank, world_size=world)
    defaults = (None, True, phases.COPY_PATH_CREW_BYTES, shm_collectives.WHOLE_CHUNKS_WORLD)
    never, always = dict.fromkeys(direct.MEASURED, INF), dict.fromkeys(direct.MEASURED, 1)
    # variant: (direct.CMA_BYTES, crew.ENABLED, phases.COPY_PATH_CREW_BYTES, WHOLE_CHUNKS_WORLD)
    settings = {"copy": (never, True, defaults[2], 0), "copyc": (never, True, 0, 0),
                "copy1": (never, False, defaults[2], 0), "whole": (never, True, defaults[2], world),
                "cma": (always, True, defaults[2], 0), "reg": defaults, "reg1": (None, False, *defaults[2:])}
    chosen = os.environ.get("AB_VARIANTS", ",".join(VARIANTS)).split(",")  # e.g. AB_VARIANTS=copy,reg,gloo
    rows = []
    for collective in collectives:
        variants = [v for v in VARIANTS if (v != "whole" or collective == "all_reduce") and v in chosen]
        for nbytes in sizes:
            n = nbytes // 4 // world * world
            block = n // world
            data = np.full(n, rank + 1, np.float32)
            template, out = data.copy(), np.zeros(n, np.float32)
            numpy_args = (data, out, block, data[:block])
            shared, shared_out = chorus.empty_shared(n, np.float32), chorus.empty_shared(n, np.float32)
            shared_args = (shared, shared_out, block, shared[:block])
            torch_args = (torch.from_numpy(data), torch.from_numpy(out), block, torch.from_numpy(data[:block]))
            times: dict[str, list[float]] = {v: [] for v in variants}
            for r in range(rounds + 1):  # round 0 warms up
                for variant in variants[r % len(variants):] + variants[:r % len(variants)]:  # rotating:
                    # the first op after the previous round's gloo op runs on colder caches
                    api, args = (tdist, torch_args) if variant == "gloo" else \
                        (chorus, shared_args if variant.startswith("reg") else numpy_args)
                    if variant != "gloo":
                        (direct.CMA_BYTES, crew.ENABLED, phases.COPY_PATH_CREW_BYTES,
                         shm_collectives.WHOLE_CHUNKS_WORLD) = settings[variant]
                        chorus.group.WORLD.shm.plans.clear()  # one-shot plans depend on WHOLE_CHUNKS_WORLD
                    (shared if variant.startswith("reg") else data)[...] = template
                    api.barrier()
                    start = time.perf_counter()
                    _step(api, collective, *args)
                    if r:
                        times[variant].append(time.perf_counter() - start)
            (direct.CMA_BYTES, crew.ENABLED, phases.COPY_PATH_CREW_BYTES,
             shm_collectives.WHOLE_CHUNKS_WORLD) = defaults
            row = {"collective": collective, "nbytes": nbytes, "world": world,
                   **{v: {"median_ms": statistics.median(t) * 1e3, "min_ms": min(t) * 1e3,
                         "mean_ms": statistics.mean(t) * 1e3} for v, t in times.items()}}
            rows.append(row)
            if rank == 0:
                med = {v: row[v]["median_ms"] for v in times}
                print(f"{collective:15s} {nbytes >> 20:4d}M  "
                      + "  ".join(f"{v} {med[v]:8.2f} (min {row[v]['min_ms']:.2f} mean {row[v]['mean_ms']:.2f})"
                                  for v in times)
                      + "".join(f"  gloo/{v} {med['gloo'] / med[v]:.2f}x" for v in times if v != "gloo"),
                      flush=True)
    if rank == 0:
        with open(os.path.join(outdir, "ab.json"), "w") as f:
            json.dump(rows, f, indent=1)
    chorus.destroy_process_group()
    tdist.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    world, outdir, rounds = int(argv[0]), argv[1], int(argv[2])
    collectives = argv[3].split(",")
    sizes = [int(float(x) * (1 << 20)) for x in argv[4].split(",")]
    return spawn(rank_main, world, outdir, sizes, collectives, rounds, outdir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
