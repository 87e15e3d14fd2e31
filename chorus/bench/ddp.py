"""``chorus bench-ddp``: time a DistributedDataParallel training step with backend "chorus"
against the same step with torch's gloo, in one run, and show where the time goes.

The ranks (``--world``, spawned here) hold a torch default group on chorus and a gloo
group beside it, and one copy of an MLP (``features -> hidden -> hidden -> 1``, ReLU,
seeded: ``--features 2048 --hidden 4096`` is ~25M parameters) per variant.  Every step
all variants run one after the other (their order rotating step by step) on the same
batch, each after a barrier:

    compute            the model alone: forward, backward, SGD step (no DDP)
    ddp no_sync        DDP (gloo group) inside no_sync(): DDP's own cost, no communication
    ddp gloo           DDP on the gloo group
    ddp chorus         DDP on the chorus group
    all_reduce gloo    DDP's gradient buckets (their sizes read from DDP), all_reduced
    all_reduce chorus  back to back with async_op=True, then waited for (no compute)

A variant's step time is the slowest rank's; the table gives its median and minimum
over the timed steps, the CPU time of a rank's process in the step (all threads, mean
over ranks) and, for DDP and all_reduce, chorus's median over gloo's; below it, what
communication adds to a step through each library (ddp - ddp no_sync).  The two DDP
models start equal and see the same data, so their losses agree step by step (printed:
the largest difference).  Exits 1 if they do not, 2 on bad arguments.

``--grad-as-bucket-view`` and glibc's ``MALLOC_*`` variables (inherited by the ranks and
named in the first line) change the compute part for both libraries alike; see
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

from chorus.bench.cli import TRANSPORTS, chosen_transport

VARIANTS = ("compute", "ddp no_sync", "ddp gloo", "ddp chorus", "all_reduce gloo", "all_reduce chorus")
#: Losses of the two DDP models may differ by the summation order of the two libraries.
LOSS_RTOL = 1e-4


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def variants_for(base: str) -> tuple[str, ...]:
    """The variants with ``base`` (gloo; nccl with ``--device cuda``) as the baseline."""
    return tuple(v.replace("gloo", base) for v in VARIANTS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=_positive, default=8, help="ranks to launch on this host (default 8)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: one GPU per rank, models and data on it, backend chorus against NCCL "
                        "(variants named 'nccl' instead of 'gloo'; CHORUS_BENCH_CUDA_DRY=1: CPU and gloo)")
    p.add_argument("--steps", type=_positive, default=20, help="timed steps per variant (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3, at least 2)")
    p.add_argument("--batch", type=_positive, default=8, help="samples per rank and step (default 8)")
    p.add_argument("--features", type=_positive, default=2048, help="model input width (default 2048)")
    p.add_argument("--hidden", type=_positive, default=4096,
                   help="hidden width (default 4096: with 2048 features, 25.2M parameters)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP's bucket_cap_mb (default: DDP's own, 25 MiB with a 1 MiB first bucket)")
    p.add_argument("--grad-as-bucket-view", action="store_true",
                   help="DDP(gradient_as_bucket_view=True) for every DDP variant (saves a gradient copy)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads per rank (default: CPUs // world, at least 1)")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of: {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--transport", choices=TRANSPORTS, default=None,
                   help="chorus's transport (CHORUS_TRANSPORT; default: $CHORUS_TRANSPORT, else auto)")
    p.add_argument("--json", metavar="FILE", help="also write the settings, per-step times and losses")


def parameters(features: int, hidden: int) -> int:
    """Parameters of the benchmark's MLP (three Linear layers with biases)."""
    return features * hidden + hidden + hidden * hidden + hidden + hidden + 1


# -- one rank ------------------------------------------------------------------------------------
def mlp(cfg: dict):
    import torch

    torch.manual_seed(0)
    f, h = cfg["features"], cfg["hidden"]
    return torch.nn.Sequential(torch.nn.Linear(f, h), torch.nn.ReLU(), torch.nn.Linear(h, h),
                               torch.nn.ReLU(), torch.nn.Linear(h, 1))


def trainer(model, forward):
    """One training step of ``model`` (called through ``forward``) on (x, y): its loss."""
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.MSELoss()

    def step(x, y) -> float:
        loss = loss_fn(forward(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def _bucket_sizes(ddp, total_bytes: int) -> list[int]:
    """DDP's gradient buckets in bytes, in the order DDP reduces them, as rebuilt after the
    first step (one bucket of every gradient if this torch does not tell)."""
    try:
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
        return [b.buffer().numel() * b.buffer().element_size() for b in buckets] or [total_bytes]
    except (AttributeError, RuntimeError):
        return [total_bytes]


def rank_main(rank: int, cfg: dict, workdir: str) -> None:
    os.environ["CHORUS_TRANSPORT"] = cfg["transport"]
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import chorus.torch  # noqa: F401 - registers backend "chorus"

    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(cfg["threads"])
    world, base = cfg["world"], cfg["baseline"]
    dev = torch.device("cpu")
    if cfg["device"] == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    dist.init_process_group("chorus", init_method=f"file://{workdir}/rdzv", rank=rank, world_size=world)
    groups = {"chorus": dist.group.WORLD, base: dist.new_group(backend=base)}
    cap = {} if cfg["bucket_cap_mb"] is None else {"bucket_cap_mb": cfg["bucket_cap_mb"]}
    if dev.type == "cuda":
        cap["device_ids"] = [rank]
    cap["gradient_as_bucket_view"] = cfg["grad_as_bucket_view"]
    wanted = cfg["variants"]
    steps: dict = {}
    ddps: dict = {}
    if "compute" in wanted:
        model = mlp(cfg).to(dev)
        steps["compute"] = trainer(model, model)
    if "ddp no_sync" in wanted:
        ddp = DDP(mlp(cfg).to(dev), process_group=groups[base], **cap)
        train = trainer(ddp, ddp)

        def no_sync(x, y, ddp=ddp, train=train) -> float:
            with ddp.no_sync():
                return train(x, y)

        steps["ddp no_sync"] = no_sync
    for lib in (base, "chorus"):
        if f"ddp {lib}" in wanted or f"all_reduce {lib}" in wanted:
            ddps[lib] = DDP(mlp(cfg).to(dev), process_group=groups[lib], **cap)
            if f"ddp {lib}" in wanted:
                steps[f"ddp {lib}"] = trainer(ddps[lib], ddps[lib])

    features = cfg["features"]
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own samples
    w_true = torch.linspace(-1, 1, features).unsqueeze(1) / features ** 0.5
    buckets: list[int] = []
    times = {name: [] for name in wanted}
    cpus = {name: [] for name in wanted}
    losses = {name: [] for name in wanted if name.startswith("ddp ") and name != "ddp no_sync"}
    barrier = groups["chorus"]
    total = cfg["warmup"] + cfg["steps"]
    for i in range(total):
        if i == 2:  # DDP rebuilt its buckets in the order of the first backward, at the second step
            ddp = next(iter(ddps.values()), None)
            total_bytes = 4 * parameters(features, cfg["hidden"])
            buckets = _bucket_sizes(ddp, total_bytes) if ddp is not None else [total_bytes]
            for lib in groups:
                if f"all_reduce {lib}" in wanted:
                    flats = [torch.zeros(n // 4, device=dev) for n in buckets]
                    steps[f"all_reduce {lib}"] = _all_reducer(flats, groups[lib])
                    steps[f"all_reduce {lib}"](None, None)  # untimed warm-up, same order everywhere
        x = torch.randn(cfg["batch"], features, generator=data)
        y = (x @ w_true + 0.01 * torch.randn(cfg["batch"], 1, generator=data)).to(dev)
        x = x.to(dev)
        shift = i % len(wanted)
        for name in wanted[shift:] + wanted[:shift]:
            step = steps.get(name)
            if step is None:
                continue  # an all_reduce before the buckets are known
            dist.barrier(group=barrier)
            cpu, start = time.process_time(), time.perf_counter()
            loss = step(x, y)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
            if i >= cfg["warmup"]:
                times[name].append(seconds)
                cpus[name].append(cpu)
                if name in losses:
                    losses[name].append(loss)
    dist.barrier(group=barrier)
    with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
        json.dump({"times": times, "cpu": cpus, "losses": losses, "buckets": buckets,
                   "threads": torch.get_num_threads()}, f)
    dist.destroy_process_group()


def _all_reducer(flats, group):
    """A step that all_reduces ``flats`` (DDP's bucket sizes) back to back, then waits."""
    import torch.distributed as dist

    def step(x, y) -> None:
        works = [dist.all_reduce(t, group=group, async_op=True) for t in flats]
        for w in works:
            w.wait()
        if flats and flats[0].is_cuda:
            import torch

            torch.cuda.synchronize()  # (wait() makes the stream wait; the step ends when the GPU has)

    return step


# -- the parent ------------------------------------------------------------------------------
def summarize(per_rank: list[dict], variants: list[str], base: str = "gloo") -> dict:
    """Per variant: the slowest rank's time of every step, its median and minimum (s);
    chorus/``base`` ratios; the largest loss difference between the DDP variants."""
    out: dict = {"variants": {}, "ratios": {}}
    for name in variants:
        per_step = [max(ts) for ts in zip(*(r["times"][name] for r in per_rank), strict=True)]
        cpu = [sum(ts) / len(ts) for ts in zip(*(r["cpu"][name] for r in per_rank), strict=True)]
        if per_step:
            out["variants"][name] = {"median": statistics.median(per_step), "min": min(per_step),
                                     "cpu": statistics.median(cpu), "steps": per_step}
    for kind in ("ddp", "all_reduce"):
        c, g = out["variants"].get(f"{kind} chorus"), out["variants"].get(f"{kind} {base}")
        if c and g:
            out["ratios"][kind] = {"median": c["median"] / g["median"], "min": c["min"] / g["min"]}
    alone = out["variants"].get("ddp no_sync")
    if alone:
        out["added"] = {lib: out["variants"][f"ddp {lib}"]["median"] - alone["median"]
                        for lib in (base, "chorus") if f"ddp {lib}" in out["variants"]}
    first = per_rank[0]["losses"]
    if "ddp chorus" in first and f"ddp {base}" in first:
        pairs = list(zip(first["ddp chorus"], first[f"ddp {base}"], strict=True))
        out["loss_max_diff"] = max((abs(a - b) for a, b in pairs), default=0.0)
        out["losses_equal"] = all(abs(a - b) <= LOSS_RTOL * max(abs(a), abs(b), 1e-12) for a, b in pairs)
        out["losses"] = {"ddp chorus": first["ddp chorus"], f"ddp {base}": first[f"ddp {base}"]}
    return out


def format_table(summary: dict, base: str = "gloo") -> str:
    """The variants' median and minimum step time, CPU time per rank (ms) and chorus/``base``
    ratios (of the medians)."""
    lines = [f"{'variant':<18} {'median ms':>10} {'min ms':>9} {'cpu ms/rank':>12} {'chorus/' + base:>12}"]
    for name, v in summary["variants"].items():
        kind, _, lib = name.partition(" ")
        ratio = summary["ratios"].get(kind) if lib == "chorus" else None
        cell = f"{ratio['median']:.2f}x" if ratio else ""
        lines.append(f"{name:<18} {1e3 * v['median']:>10.1f} {1e3 * v['min']:>9.1f} "
                     f"{1e3 * v['cpu']:>12.1f} {cell:>12}")
    return "\n".join(lines)


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _malloc_env() -> dict[str, str]:
    """glibc allocator settings the ranks inherit (they change the compute part of a step:
    see docs/benchmarks.md)."""
    return {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}


def describe(cfg: dict, cpus: int) -> str:
    """The run's settings, as the first line of the output."""
    n = parameters(cfg["features"], cfg["hidden"])
    cap = cfg["bucket_cap_mb"]
    ddp = [f"bucket_cap_mb {'default' if cap is None else f'{cap:g}'}"]
    if cfg["grad_as_bucket_view"]:
        ddp.append("gradient_as_bucket_view")
    env = " ".join(f"{k}={v}" for k, v in cfg["malloc"].items())
    where = f"{cfg['world']} GPUs (one per rank), against {cfg['baseline']}" if cfg.get("device") == "cuda" else \
        f"{cfg['world']} ranks on {cpus} CPUs"
    return (f"# chorus bench-ddp: {where}, torch {cfg['torch']}, {cfg['threads']} thread(s) "
            f"per rank; MLP {cfg['features']}-{cfg['hidden']}-{cfg['hidden']}-1 ({n / 1e6:.1f}M parameters, "
            f"{4 * n / 2**20:.1f} MiB of fp32 gradients), batch {cfg['batch']} per rank, SGD; DDP "
            f"{', '.join(ddp)}; chorus transport {cfg['transport']}; {cfg['steps']} timed steps "
            f"(+{cfg['warmup']} warm-up), variants alternating step by step"
            + (f"; environment {env}" if env else ""))


def _fail(msg: str) -> int:
    print(f"chorus bench-ddp: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from chorus.launch import spawn

    transport, problem = chosen_transport(args.transport)
    if problem:
        return _fail(problem)
    from chorus import config

    gpus = args.device == "cuda" and not config.get("CHORUS_BENCH_CUDA_DRY")
    base = "nccl" if gpus else "gloo"
    allowed = variants_for(base)
    variants = ([v.strip() for v in args.variants.split(",") if v.strip()] if args.variants is not None
                else list(allowed))
    unknown = [v for v in variants if v not in allowed]
    if unknown or not variants:
        return _fail(f"--variants: unknown {unknown or 'none given'}; choose from {', '.join(allowed)}")
    if gpus:
        import torch

        if torch.cuda.device_count() < args.world:
            return _fail(f"--device cuda --world {args.world}: this machine has {torch.cuda.device_count()} "
                         "GPU(s); one per rank is needed (or CHORUS_BENCH_CUDA_DRY=1 to try it on the CPU)")
    if args.warmup < 2:
        return _fail("--warmup must be at least 2 (DDP settles its buckets in the first two steps)")
    cpus = os.cpu_count() or 1
    threads = args.threads or max(1, cpus // args.world)
    n = parameters(args.features, args.hidden)
    cfg = {"world": args.world, "steps": args.steps, "warmup": args.warmup, "batch": args.batch,
           "features": args.features, "hidden": args.hidden, "bucket_cap_mb": args.bucket_cap_mb,
           "grad_as_bucket_view": args.grad_as_bucket_view, "malloc": _malloc_env(),
           "threads": threads, "variants": variants, "transport": transport, "torch": _torch_version(),
           "device": "cuda" if gpus else "cpu", "baseline": base}
    print(describe(cfg, cpus), flush=True)
    with tempfile.TemporaryDirectory(prefix="chorus-bench-ddp-") as workdir:
        spawn(rank_main, args=(cfg, workdir), nprocs=args.world)
        per_rank = []
        for rank in range(args.world):
            with open(os.path.join(workdir, f"rank{rank}.json")) as f:
                per_rank.append(json.load(f))
    summary = summarize(per_rank, variants, base)
    buckets = per_rank[0]["buckets"]
    print(f"# DDP buckets (MiB, in reduction order): {', '.join(f'{b / 2**20:.2f}' for b in buckets)}")
    print("# step time = the slowest rank's, each variant started after a barrier; cpu = CPU time of "
          f"a rank's process (all its threads) in the step, mean over ranks; chorus/{base} = chorus's "
          f"median / {base}'s")
    print(format_table(summary, base))
    for kind, r in summary["ratios"].items():
        print(f"# {kind}: chorus/{base} {r['median']:.2f}x (medians), {r['min']:.2f}x (minima)")
    added = summary.get("added")
    if added:
        print("# added to a step by communication (ddp X - ddp no_sync, medians): "
              + ", ".join(f"{lib} {1e3 * t:.1f} ms" for lib, t in added.items()))
    ok = summary.get("losses_equal", True)
    if "loss_max_diff" in summary:
        print(f"# losses ddp chorus vs ddp {base}: largest difference {summary['loss_max_diff']:.3g} "
              f"over {len(summary['losses'][f'ddp {base}'])} steps "
              f"({'equal' if ok else f'DIFFERENT: more than {LOSS_RTOL:g} relative'})")
    if args.json:
        meta = {**cfg, "parameters": n, "buckets": buckets, "cpus": cpus,
                "host": {"hostname": socket.gethostname(), "python": platform.python_version(),
                         "platform": platform.platform()}}
        with open(args.json, "w") as f:
            json.dump({"settings": meta, **summary}, f, indent=1)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chorus bench-ddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
