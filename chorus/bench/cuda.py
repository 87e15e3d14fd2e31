"""``chorus bench --device cuda``: chorus's CUDA collectives against torch's NCCL (and,
for all_reduce, torch's symmetric-memory one-shot / two-shot kernels where torch has
them) in the same processes, one per GPU, alternating library by library at every size.

Per size and library, on every rank:

* a check: the op once on integer-valued data (exact in every dtype and every sum), the
  result compared bit for bit with NCCL's (``#wrong``: differing elements, all ranks);
* a timed batch of ``iters`` back-to-back eager calls on the caller's stream, after
  ``warmup`` untimed ones.  The GPU is first held by a sleep kernel long enough for the
  CPU to enqueue the whole batch, so ``time us`` is the GPU time per call (CUDA events
  around the batch / iters) whatever the CPU costs; ``cpu us`` is the CPU time per call
  of the same enqueues (perf_counter around the batch / iters).  ``--unheld``: no
  sleep kernel, so ``time us`` is the longer of the CPU's and the GPU's cost per call,
  what an eager training or inference loop sees (a small NCCL all_reduce is bound by its
  CPU cost there, not by its GPU time).

Rank 0's times are reported (every rank's ``#wrong`` summed).  The ranks agree after every
case (over chorus's CPU path, which no GPU failure touches) on which libraries still run,
so a library that failed on one rank is dropped on all of them and no rank waits for a
peer that gave up.  The whole run is bounded by ``--time-limit``: then the ranks are
killed and the sizes done so far reported.

Libraries: ``chorus`` (the public API: ``chorus.all_reduce(t)``; ``--algorithm`` passes
chorus's ``algorithm=``), ```chorus:<algorithm>`` (``--algorithm a,b``: one column per chorus
algorithm), ``chorus-lane`` (all_reduce only, with ``--lane``: the
component's ``all_reduce_now``, the cached-plan path an API fast lane would call),
``nccl`` (torch.distributed, NCCL, NCCL_NVLS_ENABLE=0 unless set), ``symm-1shot`` and
``symm-2shot`` (all_reduce only: torch.ops.symm_mem.one_shot_all_reduce /
two_shot_all_reduce_ on a symmetric buffer; a baseline only).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import traceback

from chorus import config
from chorus.bench import progress
from chorus.bench.cuda_report import format_round_ranges, format_table, median_rows, merge
from chorus.bench.progress import Progress
from chorus.host import cpus

CUDA_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
CUDA_DTYPES = ("bfloat16", "float16", "float32", "float64", "int32", "int64", "int8", "uint8")
OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG"}
#: CHORUS_BENCH_CUDA_DRY=1: the same code on CPU tensors with gloo for NCCL (the tests'
#: way to run it without a GPU; times are CPU times then)
DRY = config.get("CHORUS_BENCH_CUDA_DRY")
DEV = "cpu" if DRY else "cuda"
SLEEP_CAP_S = 0.25  # the longest head start the GPU waits for the CPU to enqueue a batch
CLOCK_HZ = 1.98e9  # sleep cycles per second (H100/H200 boost clock; slower clocks sleep longer)


def iterations(iters: int, warmup: int, nbytes: int, scale: bool) -> tuple[int, int]:
    """(iters, warmup) for a message of ``nbytes``: with ``scale``, above 1 MiB the counts
    shrink with the size (at least 5 and 2)."""
    if not scale or nbytes <= 1 << 20:
        return iters, warmup
    f = (1 << 20) / nbytes
    return max(5, int(iters * f)), max(2, int(warmup * f))


# -- one rank -------------------------------------------------------------------------------------
def _data(torch, n: int, dtype, rank: int, salt: int = 0):
    """Small integers, exact in every dtype and in every sum of a few ranks."""
    v = (torch.arange(n, device=DEV, dtype=torch.int64) * 7 + rank * 3 + salt) % 4
    if dtype.is_floating_point or dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        v = v - 1
    return v.to(dtype)


class _Cases:
    """The op of each library for one (collective, count) on this rank: ``make(lib)`` ->
    (run: one call on fixed buffers, result: the tensor to compare after ``run``, reset:
    put the check's input back)."""

    def __init__(self, torch, tdist, chorus, cfg, rank, world, count):
        self.torch, self.tdist, self.chorus = torch, tdist, chorus
        self.cfg, self.rank, self.world, self.count = cfg, rank, world, count
        self.dtype = getattr(torch, cfg["dtype"])
        self.op = cfg["op"]

    def make(self, lib: str):
        torch, tdist, chorus = self.torch, self.tdist, self.chorus
        coll, n, w, r = self.cfg["collective"], self.count, self.world, self.rank
        t_op = getattr(tdist.ReduceOp, OPS[self.op])
        c_op = getattr(chorus.ReduceOp, OPS[self.op])
        algo = lib.split(":", 1)[1] if ":" in lib else self.cfg.get("algorithm") or None
        api = chorus if lib.startswith("chorus") else tdist
        op = c_op if api is chorus else t_op
        extra = {"algorithm": algo} if api is chorus and algo else {}
        if coll == "all_reduce":
            if lib.startswith("symm"):
                return self._symm(lib)
            buf = torch.empty(n, dtype=self.dtype, device=DEV)
            if lib == "chorus-lane":
                from chorus.api.state import current
                from chorus.components.select import device_component

                comp = device_component(current().default_group, "cuda")

                def run():
                    if not comp.all_reduce_now(buf, c_op):
                        chorus.all_reduce(buf, op=c_op)
            else:
                def run():
                    api.all_reduce(buf, op=op, **extra)
            return run, buf, lambda: buf.copy_(_data(torch, n, self.dtype, r))
        if coll == "broadcast":
            buf = torch.empty(n, dtype=self.dtype, device=DEV)
            return (lambda: api.broadcast(buf, src=0, **extra)), buf, lambda: buf.copy_(_data(torch, n, self.dtype, r))
        chunk = n // w
        if coll == "all_gather":
            inp = torch.empty(chunk, dtype=self.dtype, device=DEV)
            out = torch.empty(n, dtype=self.dtype, device=DEV)
            return ((lambda: api.all_gather_into_tensor(out, inp, **extra)), out,
                    lambda: (inp.copy_(_data(torch, chunk, self.dtype, r)), out.zero_()))
        if coll == "reduce_scatter":
            inp = torch.empty(n, dtype=self.dtype, device=DEV)
            out = torch.empty(chunk, dtype=self.dtype, device=DEV)
            return ((lambda: api.reduce_scatter_tensor(out, inp, op=op, **extra)), out,
                    lambda: (inp.copy_(_data(torch, n, self.dtype, r)), out.zero_()))
        if coll == "all_to_all":
            inp = torch.empty(n, dtype=self.dtype, device=DEV)
            out = torch.empty(n, dtype=self.dtype, device=DEV)
            return ((lambda: api.all_to_all_single(out, inp, **extra)), out,
                    lambda: (inp.copy_(_data(torch, n, self.dtype, r)), out.zero_()))
        raise ValueError(f"chorus bench --device cuda cannot run {coll}")

    def _symm(self, lib: str):
        import torch.distributed._symmetric_memory as symm

        torch, n = self.torch, self.count
        group = self.tdist.group.WORLD.group_name
        if hasattr(symm, "enable_symm_mem_for_group"):
            import warnings

            with warnings.catch_warnings():  # newer torch: deprecated, and not needed
                warnings.simplefilter("ignore", FutureWarning)
                try:
                    symm.enable_symm_mem_for_group(group)
                except Exception:  # noqa: BLE001 - not needed there either
                    pass
        buf = symm.empty(n, dtype=self.dtype, device=torch.device("cuda", torch.cuda.current_device()))
        symm.rendezvous(buf, group)
        red = {"sum": "sum", "avg": "avg", "max": "max", "min": "min"}.get(self.op)
        if red is None:
            raise ValueError(f"symmetric memory has no reduction {self.op}")
        holder = [buf]
        if lib == "symm-1shot":
            def run():
                holder[0] = torch.ops.symm_mem.one_shot_all_reduce(buf, red, group)
        else:
            def run():
                torch.ops.symm_mem.two_shot_all_reduce_(buf, red, group)
                holder[0] = buf

        class Result:  # the tensor the last call produced
            def __getattr__(self, name):
                return getattr(holder[0], name)

        def reset():
            buf.copy_(_data(torch, n, self.dtype, self.rank))
            holder[0] = buf

        return run, Result(), reset


def _sync(torch) -> None:
    if not DRY:
        torch.cuda.synchronize()


@contextlib.contextmanager
def _no_gc():
    """The cyclic garbage collector off for a timed loop, as timeit does: a full
    collection (tens of milliseconds with torch loaded) landing in one rank's loop once
    stalls its GPU and, through the barriers, every peer's, and is the allocation pattern
    of the whole process, not of the op timed."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _time(torch, chorus, run, iters: int, warmup: int, held: bool = True) -> tuple[float, float]:
    """(GPU seconds, CPU seconds) per call of ``iters`` back-to-back calls.  Every rank
    holds its GPU equally long (the ranks agree on the longest CPU estimate first, which
    also lines them up), so no rank's first call waits for a peer still asleep.  Not
    ``held``: the GPU runs each call as soon as it is enqueued, so the time per call is
    whichever of the CPU's enqueue and the GPU's work is longer (what an eager loop gets)."""
    if DRY:
        for _ in range(warmup):
            run()
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        cpu = (time.perf_counter() - t0) / iters
        return cpu, cpu
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(warmup):
        run()
    cpu_est = (time.perf_counter() - t0) / max(1, warmup)
    torch.cuda.synchronize()
    import numpy as np

    est = np.array([cpu_est], np.float64)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with _no_gc():  # (its collection before the line-up, which it would otherwise skew)
        chorus.all_reduce(est, op=chorus.ReduceOp.MAX)
        if held:
            sleep_s = min(SLEEP_CAP_S, float(est[0]) * iters * 1.5 + 200e-6)
            torch.cuda._sleep(int(sleep_s * CLOCK_HZ))
        start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        cpu = (time.perf_counter() - t0) / iters
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters, cpu


def _captured(torch, run, calls: int, warmup: int):
    """A CUDA graph of ``calls`` calls of ``run``, captured after ``warmup`` eager calls on
    a side stream (torch's recipe: the capture then allocates nothing new)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    torch.cuda.synchronize()
    return graph


def _time_graphed(torch, chorus, run, iters: int, warmup: int) -> tuple[float, float]:
    """(GPU seconds, CPU seconds) per call of ``iters`` calls captured in one graph and
    replayed once (after an untimed replay); the ranks line up first."""
    import numpy as np

    graph = _captured(torch, run, iters, warmup)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with _no_gc():
        chorus.all_reduce(np.zeros(1), op=chorus.ReduceOp.MAX)  # line the ranks up
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        cpu = (time.perf_counter() - t0) / iters
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters, cpu


def _workspace_note(chorus) -> str:
    """What the group's CUDA workspace takes on this rank's GPU, and how long the group's
    first CUDA call took to make it."""
    from chorus.api.state import current
    from chorus.components.select import device_component

    ws = getattr(device_component(current().default_group, "cuda"), "ws", None)
    if ws is None:
        return "chorus's CUDA workspace: none of this group's own (staged, or rails across hosts)"
    from chorus.cuda.setup import phase_note

    return (f"chorus's CUDA workspace: {ws.layout.total / 2**20:.1f} MiB per GPU, allocated, mapped and checked in "
            f"{ws.setup_s:.3f} s ({phase_note(ws.phases)})")


def _agree(chorus, ok: bool) -> bool:
    """Whether every rank's ``ok`` holds (chorus's CPU path: untouched by GPU failures)."""
    import numpy as np

    flag = np.array([1 if ok else 0], np.int32)
    chorus.all_reduce(flag, op=chorus.ReduceOp.MIN)
    return bool(flag[0])


#: what the header line says of each --bind
BIND_NOTES = {"none": "", "gpu": ", each rank on the CPUs of its GPU",
              "exclusive": ", each rank on its own share of its GPU's CPUs"}


def _gpu_cpus(torch, rank: int):
    """The CPUs local to GPU ``rank`` that this process may use, or why there are none."""
    props = torch.cuda.get_device_properties(rank)
    ids = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    if None in ids:
        return f"torch {torch.__version__} does not give the GPU's PCI address"
    allowed = (cpus.pci_local_cpus(*ids) or set()) & cpus.affinity()
    return allowed or f"the system lists no CPUs of GPU {rank} that this process may use"


def _bind(torch, rank: int, world: int = 1, exclusive: bool = False) -> str:
    """Bind this process to the CPUs local to GPU ``rank`` (``--bind gpu``), or to its
    share of them (``--bind exclusive``: the ranks whose GPUs have the same CPUs split
    their physical cores into runs of whole cores, in rank order, the first ranks one
    core more where they do not divide evenly, so that no two ranks share a core): every
    thread it has (torch's too), and so every thread started later (NCCL's, chorus's); a
    note of what it did."""
    allowed = _gpu_cpus(torch, rank)
    if isinstance(allowed, str):
        return f"rank {rank}: not bound ({allowed})"
    what, overlap = "the CPUs local to GPU", ""
    if exclusive:
        local = {r: allowed if r == rank else _gpu_cpus(torch, r) for r in range(world)}
        sharers = [r for r in range(world) if local[r] == allowed]
        if any(isinstance(c, set) and c & allowed and c != allowed for c in local.values()):
            overlap = "; other GPUs' CPU lists overlap these, so shares may too"
        units, k = cpus.cores(allowed), len(sharers)
        if len(units) < k:
            return f"rank {rank}: not bound ({len(units)} cores local to GPU {rank} for {k} ranks)"
        i, per, extra = sharers.index(rank), len(units) // k, len(units) % k
        first = i * per + min(i, extra)
        mine = units[first:first + per + (i < extra)]
        allowed = {cpu for core in mine for cpu in core}
        if k > 1:
            what = f"its {len(mine)} of the {len(units)} cores local to GPU"
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
            os.sched_setaffinity(int(task), allowed)
    return f"rank {rank}: bound to {what} {rank}: {cpus.format_cpulist(allowed)}{overlap}"


def rank_main(rank: int, cfg: dict, workdir: str) -> None:
    import torch
    import torch.distributed as tdist

    import chorus

    world = cfg["world"]
    bound = None
    if cfg.get("bind") in ("gpu", "exclusive"):
        bound = (f"rank {rank}: not bound (a dry run has no GPU)" if DRY
                 else _bind(torch, rank, world, cfg["bind"] == "exclusive"))
    if DRY:
        tdist.init_process_group("gloo", init_method=f"file://{workdir}/torch.rdzv", rank=rank,
                                 world_size=world)
    else:
        torch.cuda.set_device(rank)
        tdist.init_process_group("nccl", init_method=f"file://{workdir}/torch.rdzv", rank=rank,
                                 world_size=world, device_id=torch.device("cuda", rank))
    chorus.init_process_group("chorus", init_method=f"file://{workdir}/chorus.rdzv", rank=rank,
                              world_size=world, timeout=cfg["timeout"])
    rows, notes = [], ([] if bound is None else [bound])
    libs = list(cfg["libraries"])
    out_path = os.path.join(workdir, f"rows-{rank}.json")

    def save():
        with open(out_path + ".tmp", "w") as f:
            json.dump({"rows": rows, "notes": notes}, f)
        os.replace(out_path + ".tmp", out_path)

    item = torch.empty(0, dtype=getattr(torch, cfg["dtype"])).element_size()
    graphed = cfg.get("graph", False) and not DRY
    per_round = len(cfg["counts"]) // cfg.get("rounds", 1)
    for index, count in enumerate(cfg["counts"], start=1):
        nbytes, round_ = count * item, (index - 1) // per_round
        first = len(rows)
        iters, warmup = iterations(cfg["iters"], cfg["warmup"], nbytes, cfg["scale_iters"])
        cases = _Cases(torch, tdist, chorus, cfg, rank, world, count)
        reference = None
        for lib in list(libs):
            if lib.startswith("symm") and nbytes > cfg["symm_max"]:
                continue
            ok, row = True, None
            try:
                run, result, reset = cases.make(lib)
                once = _captured(torch, run, 1, warmup) if graphed else None
                reset()
                _sync(torch)
                tdist.barrier()
                if graphed:
                    once.replay()
                else:
                    run()
                _sync(torch)
                got = result.contiguous().view(-1)
                if lib == "nccl":
                    reference = got.clone()
                    wrong = 0
                elif reference is None:
                    wrong = -1  # nothing to compare with
                else:
                    wrong = int((got.view(torch.uint8).view(-1, item) != reference.view(torch.uint8).view(-1, item))
                                .any(dim=1).sum().item()) if got.numel() == reference.numel() else got.numel()
                tdist.barrier()
                if graphed:
                    gpu, cpu = _time_graphed(torch, chorus, run, iters, warmup)
                else:
                    gpu, cpu = _time(torch, chorus, run, iters, warmup, held=not cfg.get("unheld", False))
                row = {"library": lib, "nbytes": nbytes, "count": count, "seconds": gpu, "cpu_seconds": cpu,
                       "wrong": wrong, "iters": iters, "round": round_}
                del run, result, reset, once
            except Exception as exc:  # noqa: BLE001 - agreed on below, reported in the notes
                ok = False
                notes.append(f"rank {rank}: {lib} at {nbytes} B failed: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}")
                if cfg.get("verbose"):
                    traceback.print_exc()
            if not _agree(chorus, ok):  # raises if chorus's group broke: the rank ends, the parent reports
                libs.remove(lib)
                which = f" (round {round_ + 1})" if per_round < len(cfg["counts"]) else ""
                notes.append(f"{lib} dropped at {nbytes} B{which} and left out from then on (a rank failed)")
                try:
                    _sync(torch)
                except Exception:  # noqa: BLE001 - a broken context: the next library fails too
                    pass
                continue
            rows.append(row)
            if lib.startswith("chorus") and not DRY and not any("CUDA workspace" in n for n in notes):
                notes.append(f"rank {rank}: {_workspace_note(chorus)}")
        save()
        if rank == 0:
            progress.record(workdir, "chorus", index, {r["library"]: r["seconds"] for r in rows[first:]})
        if not libs:
            break
    save()
    _sync(torch)
    tdist.barrier()
    chorus.destroy_process_group()
    tdist.destroy_process_group()


# -- the parent -----------------------------------------------------------------------------------
def run(args) -> int:
    """``chorus bench --device cuda`` (see the module docstring); 1 if any result was
    wrong or chorus failed, 2 on bad arguments."""
    from chorus.bench.sizes import parse_size, sweep

    def fail(msg: str) -> int:
        print(f"chorus bench: error: {msg}", file=sys.stderr)
        return 2

    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError:
        return fail("--device cuda needs torch with CUDA")
    gpus = 2 if DRY else torch.cuda.device_count()
    if not DRY and not torch.cuda.is_available():
        return fail("--device cuda: no CUDA device here")
    if args.collective not in CUDA_COLLECTIVES:
        return fail(f"--device cuda runs {', '.join(CUDA_COLLECTIVES)}, not {args.collective}")
    dtype = args.dtype or "bfloat16"
    if dtype not in CUDA_DTYPES:
        return fail(f"--device cuda: dtype {dtype} is not one of {', '.join(CUDA_DTYPES)}")
    if args.op not in OPS:
        return fail(f"--device cuda: op {args.op} is not one of {', '.join(OPS)}")
    world = args.world or gpus
    if world > gpus or world < 1:
        return fail(f"--world {world}: this host has {gpus} GPUs")
    try:
        sizes = sweep(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    except ValueError as exc:
        return fail(str(exc))
    item = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    unit = 1 if args.collective in ("all_reduce", "broadcast") else world
    counts: list[int] = []
    for nbytes in sizes:
        c = nbytes // item // unit * unit
        if c > 0 and c not in counts:
            counts.append(c)
    if not counts:
        return fail("no size holds a whole element per rank")
    baseline = args.baseline if args.baseline in ("nccl", "symm", "none") else "auto"
    algos = [a for a in (args.algorithm or "").split(",") if a]
    libs = ["chorus"] if len(algos) < 2 else [f"chorus:{a}" for a in algos]
    libs += ["chorus-lane"] if args.lane and args.collective == "all_reduce" and not DRY else []
    libs += ["nccl"] if baseline != "none" else []
    if (args.collective == "all_reduce" and baseline in ("auto", "symm") and args.op in ("sum", "avg", "max", "min")
            and not DRY):
        libs += ["symm-1shot", "symm-2shot"]
    # NCCL first at every size: the others are checked against its result
    order = [lib for lib in ("nccl", *libs) if lib in libs]
    order = list(dict.fromkeys(order))
    rounds = getattr(args, "rounds", 1)
    cfg = {"world": world, "counts": counts * rounds, "rounds": rounds, "iters": args.iters, "warmup": args.warmup,
           "scale_iters": args.scale_iters, "collective": args.collective, "dtype": dtype, "op": args.op,
           "algorithm": args.algorithm, "libraries": order,
           "timeout": float(args.cuda_timeout), "symm_max": parse_size(args.symm_max),
           "verbose": config.get("CHORUS_BENCH_VERBOSE"), "graph": bool(getattr(args, "graph", False)),
           "unheld": bool(getattr(args, "unheld", False)), "bind": getattr(args, "bind", "none")}
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = "CPU (dry run)" if DRY else torch.cuda.get_device_name(0)
    reducing = args.collective in ("all_reduce", "reduce_scatter")
    print(f"# chorus bench --device cuda: {args.collective}{' ' + args.op if reducing else ''}, "
          f"{world} ranks ({device}), dtype {dtype}, chorus algorithm "
          f"{args.algorithm or 'auto'}; libraries {', '.join(order)}; {args.iters} iterations "
          f"(+{args.warmup} warm-up){', scaled down above 1 MiB' if args.scale_iters else ''}"
          f"{', captured in a CUDA graph and replayed' if cfg['graph'] else ', eager'}"
          f"{', the GPU not held' if cfg['unheld'] and not cfg['graph'] else ''}"
          f"{BIND_NOTES[cfg['bind']]}"
          f"{f', {rounds} rounds (each size once a round)' if rounds > 1 else ''}; "
          f"torch {torch.__version__}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}", flush=True)
    deadline = time.monotonic() + args.time_limit
    timed_out = False
    with tempfile.TemporaryDirectory(prefix="chorus-bench-cuda-") as workdir:
        ctx = mp.start_processes(rank_main, args=(cfg, workdir), nprocs=world, join=False, start_method="spawn")
        error = None
        shown = Progress(workdir, ["chorus"], [c * item for c in cfg["counts"]])
        shown.waiting(f"starting {world} ranks ...")
        try:
            while True:
                shown.poll()
                try:
                    if ctx.join(timeout=0.25):
                        break
                except Exception as exc:  # noqa: BLE001 - a rank died: report what was done
                    error = exc
                    break
                if time.monotonic() > deadline:
                    timed_out = True
                    break
        finally:
            shown.close()
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
        rows, notes = merge(workdir, world)
    if timed_out:
        notes.append(f"stopped after --time-limit {args.time_limit} s; the ranks were killed")
    if error is not None:
        notes.append(f"a rank failed: {str(error).strip().splitlines()[-1] if str(error).strip() else error!r}")
    timing = ("CUDA events around one replay of a graph of the calls); cpu: CPU us per call of that replay"
              if cfg["graph"] else "CUDA events around back-to-back eager calls, the GPU not held: the longer "
              "of the CPU's enqueue and the GPU's work); cpu: CPU us per call" if cfg["unheld"]
              else "CUDA events around back-to-back eager calls, the GPU held until the CPU "
              "enqueued them all); cpu: CPU us per call")
    print(f"# time: GPU us per call ({timing}; algbw, busbw GB/s; #wrong: elements differing from "
          "NCCL's result (-1: no NCCL result to compare); x B: B's time / chorus's")
    for note in notes:
        print(f"# {note}")
    rows_by_round, times_by_round = rows, None
    if rounds > 1:
        rows, times_by_round = median_rows(rows)
        print(f"# the medians over {rounds} rounds of each size's GPU and CPU time per call")
    print(format_table(rows, args.collective, world, dtype), flush=True)
    if times_by_round is not None:
        print(f"# each baseline's time over chorus's in each of the {rounds} rounds: lowest-highest")
        print(format_round_ranges(times_by_round), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"collective": args.collective, "dtype": dtype, "op": args.op, "world": world,
                       "algorithm": args.algorithm or "auto", "libraries": order, "iters": args.iters,
                       "warmup": args.warmup, "scale_iters": args.scale_iters, "graph": cfg["graph"],
                       "unheld": cfg["unheld"], "notes": notes,
                       "device": device, "torch": torch.__version__,
                       "timing": "seconds: GPU time per call on rank 0"
                                 + (" (the GPU not held: the longer of CPU and GPU time per call)"
                                    if cfg["unheld"] and not cfg["graph"] else "")
                                 + "; cpu_seconds: CPU time per call",
                       "rounds": rounds, "rows": rows, **({"rows_by_round": rows_by_round} if rounds > 1 else {})},
                      f, indent=1)
        print(f"# wrote {args.json}")
    bad = any(r["wrong"] > 0 for r in rows) or not any(r["library"].split(":")[0] == "chorus" for r in rows)
    bad = bad or any(n.startswith("chorus") and "dropped" in n for n in notes) or timed_out or error is not None
    return 1 if bad else 0
