"""``chorus bench``: argument parsing and the run that launches its own ranks."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile

from chorus.bench.report import BUS_FACTOR, Row, format_table
from chorus.bench.sizes import parse_size, sweep


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", default="8", help="smallest message (e.g. 8, 1K, 1M)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest message")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this each step")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations per size")
    p.add_argument("--collective", default="sendrecv", choices=sorted(BUS_FACTOR))
    p.add_argument("--dtype", default="float32")
    p.add_argument("--world", type=int, default=2, help="number of ranks to launch on this host")
    p.add_argument("--baseline", default="auto", choices=["auto", "gloo", "none"],
                   help="also time torch gloo (auto: when torch is installed)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")


def run(args: argparse.Namespace) -> int:
    from chorus.launch import spawn

    baselines = []
    if args.baseline == "gloo" or (args.baseline == "auto" and importlib.util.find_spec("torch")):
        baselines.append("gloo")
    sizes = sweep(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    cfg = {"world": args.world, "sizes": sizes, "iters": args.iters, "warmup": args.warmup,
           "collective": args.collective, "dtype": args.dtype, "baselines": baselines}
    with tempfile.TemporaryDirectory(prefix="chorus-bench-") as workdir:
        from chorus.bench.worker import rank_main

        spawn(rank_main, args=(cfg, workdir), nprocs=args.world)
        with open(f"{workdir}/rows.json") as f:
            rows = [Row(**r) for r in json.load(f)]
    print(f"# chorus bench: {args.collective}, {args.world} ranks, dtype {args.dtype}, "
          f"{args.iters} iterations (+{args.warmup} warm-up); mean time per op on rank 0, inputs reset and results checked between ops (untimed); GB/s")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1)
    return 1 if any(r.wrong for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chorus bench", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
