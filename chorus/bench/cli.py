"""``chorus bench``: time collectives over chorus and, in the same invocation, over torch
gloo and MPI (mpi4py) when they are installed; print nccl-tests columns and chorus's
speed-up over each baseline; optionally write JSON and a PNG plot.

chorus and gloo run in one set of ranks (spawned here), alternating per size; MPI runs in
its own ``mpiexec`` job beside them, with the same sizes, iterations and checks, the two
jobs taking turns size by size (the idle one sleeps).  Results are checked on every rank
after every iteration.  A line per size reports progress as the sizes finish (rewritten
in place on a terminal); the table fits 100 columns, and --json holds every figure.
Exits 1 if any library returned a wrong element (or a baseline asked for by name
failed), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import socket
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np

from chorus import config
from chorus.bench import mpi_worker, plot, turns
from chorus.bench.ops import COLLECTIVES, DTYPES, OPS, REDUCING, check_op, op_label, sweep_counts
from chorus.bench.progress import Progress
from chorus.bench.report import Row, format_rounds, format_table, medians, merge_ranks, to_json
from chorus.bench.sizes import human, parse_size, sweep

TRANSPORTS = config.SETTINGS["CHORUS_TRANSPORT"].choices
BASELINES = ("auto", "gloo", "mpi", "all", "none")
CUDA_BASELINES = ("nccl", "symm")  # --device cuda only


WIDTH = 100  # of every line chorus bench prints (the table's rows with chorus and two baselines)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` with each option's default; options whose default depends on others
    (None) or is off (False) say so in their own help instead."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def comment(text: str) -> str:
    """``text`` as ``#`` comment lines of at most WIDTH columns."""
    return textwrap.fill(text, WIDTH, initial_indent="# ", subsequent_indent="#   ",
                         break_on_hyphens=False, break_long_words=False)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", default="8", help="smallest message (e.g. 8, 1K, 1M)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest message")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this each step")
    p.add_argument("-n", "--iters", type=_positive, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup", type=_non_negative, default=5, help="untimed iterations per size")
    p.add_argument("--rounds", type=_positive, default=1,
                   help="run the whole sweep this many times, one after another (each library's sizes in "
                        "turn, as in one sweep); the table shows each library's median over the rounds, "
                        "then the range of chorus's speed-up over each baseline, and --json every round")
    p.add_argument("--scale-iters", action="store_true",
                   help="above 1 MiB, run -n x 1 MiB / size iterations (at least 5) and -w likewise "
                        "(at least 1): long sweeps to 256 MiB in seconds")
    p.add_argument("--collective", default="all_reduce", choices=COLLECTIVES, help="what to time")
    p.add_argument("--dtype", default=None, choices=DTYPES + ("bfloat16",),
                   help="element type (default float32; --device cuda: bfloat16)")
    p.add_argument("--op", default="sum", choices=list(OPS),
                   help="reduction of all_reduce, reduce and reduce_scatter (default sum)")
    p.add_argument("--world", type=_positive, default=None,
                   help="number of ranks to launch on this host (default 2; --device cuda: one per GPU)")
    p.add_argument("--transport", choices=TRANSPORTS, default=None,
                   help="chorus's transport between its ranks, passed as CHORUS_TRANSPORT "
                        "(default: $CHORUS_TRANSPORT, else auto; tcp = no shared memory)")
    p.add_argument("--baseline", default="auto", choices=BASELINES + CUDA_BASELINES,
                   help="also time torch gloo and/or MPI (auto: those installed; all: both, required); "
                        "--device cuda: nccl, symm (nccl and torch's symmetric-memory all_reduce), none")
    p.add_argument("--mpiexec", metavar="PATH",
                   help="MPI launcher (default: mpiexec next to this Python, then on PATH)")
    p.add_argument("--mpi-args", metavar="ARGS", default="",
                   help="options for mpiexec before -n (one string, split as a shell would), e.g. "
                        "'--mca pml ob1 --mca btl tcp,self' for Open MPI over TCP; recorded in the notes")
    p.add_argument("--registered", action="store_true",
                   help="chorus's buffers from chorus.empty_shared (registered shared memory, which the "
                        "ranks of a host map: nccl-tests' -R); the baselines keep ordinary memory")
    p.add_argument("--json", metavar="FILE",
                   help="also write the settings and every row as JSON (count, dtype, op, algbw, busbw, "
                        "each library's #wrong, the speed-ups)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: chorus's CUDA collectives against NCCL (and torch's symmetric memory), one "
                        "process per GPU, CUDA-event GPU time and CPU time per call (chorus.bench.cuda)")
    p.add_argument("--algorithm", default=None,
                   help="--device cuda: chorus's algorithm= (all_reduce: one_shot, two_shot, two_shot_push, two_shot_stores, copy_reduce); "
                        "several, comma-separated: one column each")
    p.add_argument("--graph", action="store_true",
                   help="--device cuda: time each library's calls captured in a CUDA graph and replayed (the "
                        "check too runs a replay), instead of eager calls")
    p.add_argument("--unheld", action="store_true",
                   help="--device cuda, eager: do not hold the GPU while the CPU enqueues the timed calls, so "
                        "each call's time is the longer of its CPU and GPU costs (an eager loop's view)")
    p.add_argument("--bind", choices=("none", "gpu", "exclusive"), default="none",
                   help="--device cuda: gpu: each rank's process on the CPUs local to its GPU (the kernel's "
                        "CPU list of the GPU's PCI device), as numactl or a scheduler's CPU binding would place "
                        "it; exclusive: on its own equal share of those CPUs (ranks whose GPUs have the same "
                        "CPUs split them in rank order: no two ranks on one CPU); both libraries run in those "
                        "processes")
    p.add_argument("--lane", action="store_true",
                   help="--device cuda, all_reduce: also time the component's cached-plan lane (all_reduce_now)")
    p.add_argument("--time-limit", type=float, default=600.0,
                   help="--device cuda: stop (and kill the ranks) after this many seconds, reporting what ran")
    p.add_argument("--cuda-timeout", type=float, default=60.0,
                   help="--device cuda: chorus's group timeout (bounds every GPU spin)")
    p.add_argument("--symm-max", default="64M", help="--device cuda: largest size for the symmetric-memory baseline")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw busbw and chorus's speed-up against size (needs matplotlib)")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def choose_baselines(choice: str, mpiexec: str | None, collective: str = "all_reduce", op: str = "sum",
                     ) -> tuple[list[str], dict[str, str], str | None]:
    """(baselines to run, {skipped baseline: why}, error): a baseline named explicitly
    (``gloo``, ``mpi``, ``all``) that cannot run is an error; under ``auto`` it is skipped."""
    wanted = {"auto": ["gloo", "mpi"], "gloo": ["gloo"], "mpi": ["mpi"], "all": ["gloo", "mpi"],
              "none": []}[choice]
    reasons = {
        "gloo": None if importlib.util.find_spec("torch") else
        "torch is not installed (pip install torch, or the 'torch' extra)",
        "mpi": mpi_worker.unavailable(mpiexec),
    }
    if op == "avg" and collective in REDUCING and reasons["mpi"] is None:
        reasons["mpi"] = "MPI has no average reduction (op avg)"
    run, skipped = [], {}
    for name in wanted:
        if reasons[name] is None:
            run.append(name)
        elif choice != "auto":
            return [], {}, f"--baseline {choice}: {name} cannot run: {reasons[name]}"
        else:
            skipped[name] = reasons[name]
    return run, skipped, None


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _load_ranks(workdir: str, world: int) -> tuple[dict[int, list[Row]], list[str]]:
    per_rank, notes = {}, []
    for rank in range(world):
        with open(os.path.join(workdir, f"rows-{rank}.json")) as f:
            data = json.load(f)
        per_rank[rank] = [Row(**r) for r in data["rows"]]
        if rank == 0:
            notes = data["notes"]
    return per_rank, notes


def _run_jobs(cfg: dict, workdir: str, mpiexec: str | None, progress: Progress) -> tuple[
        dict[int, list[Row]], list[str],
        tuple[dict[int, list[Row]], list[str], dict[str, str]] | mpi_worker.MPIRunError | None]:
    """Run the chorus ranks (with gloo) and, if ``mpiexec``, the MPI job beside them,
    handing out turns size by size (``progress`` prints each size as both finished it);
    return chorus's rows per rank, its notes, and MPI's results (or why it failed; None:
    not run).  A chorus failure raises."""
    from chorus.bench.worker import rank_main
    from chorus.launch import spawn

    cfg = {**cfg, "turns": mpiexec is not None, "parent_pid": os.getpid()}
    with _env("CHORUS_TRANSPORT", cfg["transport"]):
        ctx = spawn(rank_main, args=(cfg, workdir), nprocs=cfg["world"], join=False)
    mpi_proc = None
    mpi_result: Any = None
    try:
        if mpiexec is not None:
            try:
                mpi_proc = mpi_worker.start(cfg, workdir, mpiexec)
            except mpi_worker.MPIRunError as exc:
                mpi_result = exc
                progress.drop("mpi")
            running = {"chorus": lambda: not ctx.join(timeout=0),
                       "mpi": lambda: mpi_proc is not None and mpi_proc.poll() is None}
            jobs = ["chorus"] + (["mpi"] if mpi_proc is not None else [])
            for index in range(len(cfg["counts"]) + 1):
                for job in list(jobs):
                    turns.give_turn(workdir, job, index, cfg["world"])
                    if turns.wait_done(workdir, job, index, cfg["world"], running[job]):
                        progress.poll()
                        continue
                    if job == "chorus":  # exited early: join raises the ranks' error
                        ctx.join()
                        raise RuntimeError("the chorus ranks exited before the last size")
                    jobs.remove("mpi")  # collect() below says why
                    progress.drop("mpi")
        while not ctx.join(timeout=0.25):
            progress.poll()
        if mpi_proc is not None:
            mpi_proc.wait()
            try:
                mpi_result = mpi_worker.collect(mpi_proc, workdir, cfg["world"])
            except mpi_worker.MPIRunError as exc:
                mpi_result = exc
    finally:
        turns.forget(workdir)
        if mpi_proc is not None:
            mpi_worker.stop(mpi_proc)
    per_rank, notes = _load_ranks(workdir, cfg["world"])
    return per_rank, notes, mpi_result


def _fail(msg: str) -> int:
    print(f"chorus bench: error: {msg}", file=sys.stderr)
    return 2


def chosen_transport(flag: str | None) -> tuple[str, str | None]:
    """(transport, None) from ``--transport`` or CHORUS_TRANSPORT, or ("", why it is wrong)."""
    if flag:
        return flag, None
    try:
        return config.get("CHORUS_TRANSPORT"), None
    except config.ConfigError as exc:
        return "", str(exc)


def run(args: argparse.Namespace) -> int:
    rounds = getattr(args, "rounds", 1)
    if getattr(args, "device", "cpu") == "cuda":
        from chorus.bench import cuda

        return cuda.run(args)
    if getattr(args, "bind", "none") != "none":
        return _fail("--bind is for --device cuda (it places each rank on its GPU's CPUs); on CPUs, bind the "
                     "ranks with taskset or numactl around the command")
    if args.dtype is None:
        args.dtype = "float32"
    if args.world is None:
        args.world = 2
    if args.dtype == "bfloat16":
        return _fail("--dtype bfloat16 is for --device cuda")
    if args.baseline in CUDA_BASELINES:
        return _fail(f"--baseline {args.baseline} is for --device cuda")
    transport, problem = chosen_transport(args.transport)
    if problem:
        return _fail(problem)
    problem = check_op(args.collective, args.op, args.dtype)
    if problem:
        return _fail(problem)
    try:
        sizes = sweep(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    except ValueError as exc:
        return _fail(str(exc))
    itemsize = np.dtype(args.dtype).itemsize
    counts = sweep_counts(sizes, args.collective, args.world, itemsize)
    if not counts:
        return _fail(f"no size from {human(sizes[0])} to {human(sizes[-1])} holds a whole {args.dtype} "
                     f"element{' per rank' if args.collective in ('all_gather', 'reduce_scatter', 'all_to_all') else ''}")
    if args.plot and not plot.available():
        return _fail("--plot needs matplotlib (pip install matplotlib, or the 'plot' extra)")
    mpiexec = mpi_worker.find_mpiexec(args.mpiexec)
    if args.mpiexec and mpiexec is None:
        return _fail(f"--mpiexec {args.mpiexec}: not found or not executable")
    baselines, skipped, error = choose_baselines(args.baseline, mpiexec, args.collective, args.op)
    if error:
        return _fail(error)

    versions = {"gloo": f"torch {_version('torch')}", "mpi": f"mpi4py {_version('mpi4py')}"}
    described = ", ".join(f"{b} ({versions[b]})" for b in baselines) or "none"
    op = op_label(args.collective, args.op)
    print(comment(f"chorus bench: {args.collective}{'' if op == 'none' else ' ' + op}, {args.world} ranks, "
                  f"dtype {args.dtype}, transport {transport}; baselines: {described}; "
                  f"{args.iters} iterations (+{args.warmup} warm-up) per size"
                  f"{f', {rounds} rounds' if rounds > 1 else ''}"
                  f"{', scaled down above 1 MiB' if args.scale_iters else ''}"
                  f"{'; chorus on registered buffers (chorus.empty_shared)' if args.registered else ''}"),
          flush=True)
    cfg = {"world": args.world, "counts": counts * rounds, "iters": args.iters, "warmup": args.warmup,
           "scale_iters": args.scale_iters,
           "collective": args.collective, "dtype": args.dtype, "op": args.op,
           "transport": transport, "baselines": [b for b in baselines if b != "mpi"],
           "registered": args.registered, "mpi_args": args.mpi_args}
    notes = [f"{name} skipped: {why}" for name, why in skipped.items()]
    if transport != "tcp" and importlib.util.find_spec("chorus.shm") is None:
        notes.append("this chorus has no shared-memory engine (chorus.shm): its ranks use TCP")
    baseline_info: dict[str, Any] = {}
    if "gloo" in baselines:
        baseline_info["gloo"] = {"torch": _version("torch")}
    failed = False
    with tempfile.TemporaryDirectory(prefix="chorus-bench-") as workdir:
        progress = Progress(workdir, ["chorus"] + (["mpi"] if "mpi" in baselines else []),
                            [c * itemsize for c in counts * rounds])
        progress.waiting(f"starting {args.world} ranks ...")
        try:
            per_rank, rank_notes, mpi_result = _run_jobs(cfg, workdir, mpiexec if "mpi" in baselines else None,
                                                         progress)
        finally:
            progress.close()
        rows = merge_ranks(per_rank)
        notes += rank_notes
        if isinstance(mpi_result, mpi_worker.MPIRunError):
            notes.append(f"mpi failed: {mpi_result}")
            baselines.remove("mpi")
            failed = args.baseline in ("mpi", "all")
        elif mpi_result is not None:
            mpi_ranks, mpi_notes, info = mpi_result
            rows += merge_ranks(mpi_ranks)
            notes += mpi_notes
            baseline_info["mpi"] = {**info, "mpiexec": mpiexec}
            notes.append(f"mpi: {info['library']} through mpi4py {info['mpi4py']}, launched by "
                         f"{mpiexec}{f' {args.mpi_args}' if args.mpi_args else ''}; its own job, taking "
                         "turns with chorus size by size")
    times = None
    if rounds > 1:
        rows, times = medians(rows)
    per_op = "mean time per op on rank 0" if rounds == 1 else (
        f"median over {rounds} rounds of the mean time per op on rank 0")
    print(comment(f"us: {per_op}, ops back to back in batches of up to 1 MiB of "
                  "buffers, each batch started by a barrier, each op on its own buffers, reset before "
                  "and checked after its batch, untimed; busbw: GB/s, nccl-tests' bus bandwidth; vs B: "
                  "B's time / chorus's time (above 1: chorus is faster); #wrong: wrong elements of every "
                  "library over all ranks and iterations (each library's, count, algbw: --json)"))
    for note in notes:
        for line in note.splitlines():
            print(comment(line))
    print(format_table(rows))
    if times is not None and any(lib != "chorus" for lib, _ in times):
        print(comment(f"chorus's speed-up over each baseline in each of the {rounds} rounds: lowest-highest "
                      "(rounds)"))
        print(format_rounds(times))
    wrong = sorted({r.library for r in rows if r.wrong})
    if wrong:
        print(f"# FAILED: wrong results from {', '.join(wrong)}", file=sys.stderr)
    meta = {
        "collective": args.collective, "op": op, "dtype": args.dtype, "world": args.world,
        "transport": transport, "iters": args.iters, "warmup": args.warmup, "scale_iters": args.scale_iters,
        "registered": args.registered, "mpi_args": args.mpi_args, "sizes": [c * itemsize for c in counts],
        "baseline": args.baseline, "baselines": baselines, "baselines_skipped": skipped,
        "baseline_info": baseline_info, "notes": notes,
        "rounds": rounds,
        "timing": ("seconds: mean per op on rank 0; wrong: over all ranks and iterations" if rounds == 1 else
                   f"seconds: median over {rounds} rounds of the mean per op on rank 0 (each round's: "
                   "rounds_us); wrong: over all ranks, rounds and iterations"),
        "host": {"hostname": socket.gethostname(), "cpus": os.cpu_count(),
                 "python": platform.python_version(), "numpy": np.__version__,
                 "platform": platform.platform()},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(rows, meta, times), f, indent=1)
        print(f"# wrote {args.json}")
    if args.plot:
        title = (f"{args.collective}{'' if op == 'none' else ' ' + op}, {args.dtype}, W={args.world}, "
                 f"chorus transport {transport}, {socket.gethostname()} ({os.cpu_count()} CPUs)")
        plot.write_plot(rows, args.plot, title)
        print(f"# wrote {args.plot}")
    return 1 if wrong or failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chorus bench", description=__doc__, formatter_class=HelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
