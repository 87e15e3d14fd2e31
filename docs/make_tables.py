"""Markdown tables for docs/benchmarks.md, docs/algorithms.md and README.md from the result files in
docs/results/, so that every number those pages show comes from a result file.

usage: python3 docs/make_tables.py            rewrite the tables in both pages
       python3 docs/make_tables.py --check    exit 1 if a page's tables differ from the files
       python3 docs/make_tables.py --print    print every table (NAME: only that one)
       python3 docs/make_tables.py FILE.json  nccl-tests-style table of any `chorus bench --json` file

A page holds a table between the lines ``<!-- table NAME -->`` and ``<!-- end table -->``;
the script replaces what lies between them and nothing else.  Each table names the
command that produced its files (rebuilt from the settings the files record) and the
files themselves.  The formats read are those ``chorus bench --json``
(chorus/bench/report.py, ``to_json``) and ``chorus bench-ddp --json`` (chorus/bench/ddp.py)
write.  Standard library only.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
RESULTS = os.path.join(DOCS, "results")
PAGES = (os.path.join(DOCS, "benchmarks.md"), os.path.join(DOCS, "algorithms.md"), os.path.join(ROOT, "README.md"))

XEON = "16-vcpu-xeon"
EPYC = "2-vcpu-epyc"
HOST32 = "32-vcpu-h200-host"
SWEEP_W8 = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")

#: nccl-tests' bus bandwidth factors (chorus/bench/report.py, BUS_FACTOR).
BUS_FACTOR = {
    "all_reduce": lambda w: 2 * (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "all_to_all": lambda w: (w - 1) / w,
    "broadcast": lambda w: 1.0,
    "reduce": lambda w: 1.0,
    "sendrecv": lambda w: 1.0,
    "barrier": lambda w: 0.0,
}


# --- reading -------------------------------------------------------------------------

def load(path: str) -> dict:
    with open(path if os.path.isabs(path) else os.path.join(RESULTS, path)) as f:
        return json.load(f)


def rel(path: str) -> str:
    """A result file's path from the repository root."""
    return os.path.relpath(os.path.join(RESULTS, path), ROOT)


def by_size(doc: dict) -> dict[int, dict[str, dict]]:
    """{nbytes: {library: row}}."""
    out: dict[int, dict[str, dict]] = {}
    for r in doc["rows"]:
        out.setdefault(r["nbytes"], {})[r["library"]] = r
    return out


def baselines(doc: dict) -> list[str]:
    present = {r["library"] for r in doc["rows"]}
    return [lib for lib in ("gloo", "mpi") if lib in present]


def mpi_name(doc: dict) -> str:
    """'MPICH', 'Open MPI': the MPI library the run used (its baseline_info)."""
    library = doc.get("baseline_info", {}).get("mpi", {}).get("library", "MPI")
    return "Open MPI" if library.startswith("Open MPI") else library.split()[0]


def label(doc: dict, lib: str) -> str:
    return mpi_name(doc) if lib == "mpi" else lib


def software(doc: dict) -> str:
    """What ran: CPUs, Python, numpy and the baselines' versions, from the file."""
    host, info = doc.get("host", {}), doc.get("baseline_info", {})
    parts = [f"{host.get('cpus', '?')} CPUs", f"Python {host.get('python', '?')}"]
    if "numpy" in host:
        parts.append(f"numpy {host['numpy']}")
    if "gloo" in info:
        parts.append(f"torch {info['gloo']['torch']} (gloo)")
    if "mpi" in info:
        version = info["mpi"]["library"].split(",")[0].rstrip("\x00").strip()
        parts.append(f"{version} through mpi4py {info['mpi']['mpi4py']}")
    return ", ".join(parts)


# --- formatting ----------------------------------------------------------------------

def size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def size_arg(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def ratio(x: float) -> str:
    digits = 0 if x >= 100 else 1 if x >= 10 else 2
    return f"{x:.{digits}f}x"


def us(x: float) -> str:
    return f"{x:.1f}"


def spread(values: list[float], fmt) -> str:
    """One value, or the lowest and highest of several runs."""
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}-{fmt(hi)}"


def table(head: list[str], rows: list[list[str]], right_from: int = 1) -> str:
    align = ["---" if i < right_from else "---:" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# --- commands ------------------------------------------------------------------------

def bench_command(doc: dict, collective: str | None = None, begin: int | None = None,
                  json_name: str | None = None) -> str:
    """The ``chorus bench`` command line that the file's settings record."""
    sizes = doc["sizes"]
    factors = {b // a for a, b in zip(sizes, sizes[1:], strict=False)}
    if len(factors) > 1:
        raise ValueError(f"{doc['collective']}: the sizes are no geometric sweep: {sizes}")
    parts = ["chorus bench", f"--collective {collective or doc['collective']}",
             f"-b {size_arg(sizes[0] if begin is None else begin)}", f"-e {size_arg(sizes[-1])}"]
    if factors:
        parts.append(f"-f {factors.pop()}")
    parts += [f"-n {doc['iters']}", f"-w {doc['warmup']}"]
    if doc.get("scale_iters"):
        parts.append("--scale-iters")
    if doc.get("dtype", "float32") != "float32":
        parts.append(f"--dtype {doc['dtype']}")
    if doc.get("op") not in ("sum", "none", None):
        parts.append(f"--op {doc['op']}")
    parts += [f"--world {doc['world']}", f"--transport {doc['transport']}", f"--baseline {doc['baseline']}"]
    if doc.get("registered"):
        parts.append("--registered")
    if doc.get("mpi_args"):
        parts.append(f"--mpi-args '{doc['mpi_args']}'")
    if json_name:
        parts.append(f"--json {json_name}")
    return " ".join(parts)


def wrap(command: str, width: int = 92) -> str:
    """A long command over several lines, broken before options."""
    words, lines, line = command.split(" "), [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width and w.startswith("-"):
            lines.append(line + " \\")
            line = "    " + w
        else:
            line = f"{line} {w}" if line else w
    return "\n".join(lines + [line])


def code(*commands: str) -> str:
    return "```bash\n" + "\n".join(wrap(c) for c in commands) + "\n```"


def files_line(paths: list[str]) -> str:
    return "Result files: " + ", ".join(f"`{rel(p)}`" for p in paths) + "."


# --- table kinds -------------------------------------------------------------------

@dataclass
class Nccl:
    """One run: nccl-tests' columns for every library, then chorus's speed-up."""
    path: str
    min_bytes: int = 0
    settings: dict = field(default_factory=dict)  # settings the run had that its file lacks

    def render(self) -> str:
        doc = {**load(self.path), **self.settings}
        libs = ["chorus"] + baselines(doc)
        head = ["size", "count", "type"]
        for lib in libs:
            head += [f"{label(doc, lib)} time (us)", "algbw", "busbw", "#wrong"]
        head += [f"x vs {label(doc, lib)}" for lib in libs[1:]]
        factor = BUS_FACTOR[doc["collective"]](doc["world"])
        rows = []
        for n, e in sorted(by_size(doc).items()):
            if n < self.min_bytes:
                continue
            first = e.get("chorus") or next(iter(e.values()))
            row = [size(n), str(first["count"]), first["dtype"]]
            for lib in libs:
                r = e.get(lib)
                row += ([us(r["us"]), f"{r['algbw']:.2f}", f"{r['algbw'] * factor:.2f}", str(r["wrong"])]
                        if r else ["-"] * 4)
            row += [ratio(e[lib]["us"] / e["chorus"]["us"]) if lib in e and "chorus" in e else "-"
                    for lib in libs[1:]]
            rows.append(row)
        name = os.path.basename(self.path)
        return "\n\n".join([code(bench_command(doc, json_name=name)), table(head, rows),
                            f"{software(doc)}. {files_line([self.path])}"])


@dataclass
class Runs:
    """Several runs of one command: each library's time over the runs (lowest-highest);
    chorus's speed-up over the baseline run by run (over several baselines: lowest-highest)."""
    paths: list[str]

    def render(self) -> str:
        docs = [load(p) for p in self.paths]
        doc = docs[0]
        commands = {bench_command(d) for d in docs}
        if len(commands) > 1:
            raise ValueError(f"{self.paths}: not one command: {sorted(commands)}")
        libs = ["chorus"] + baselines(doc)
        tables = [by_size(d) for d in docs]
        per_run = len(libs) == 2
        head = ["size"] + [f"{label(doc, lib)} time (us)" for lib in libs]
        for lib in libs[1:]:
            head += ([f"x vs {label(doc, lib)}, run {i + 1}" for i in range(len(docs))] if per_run
                     else [f"x vs {label(doc, lib)}"])
        head.append("#wrong")
        rows = []
        for n in sorted(tables[0]):
            row = [size(n)]
            row += [spread([t[n][lib]["us"] for t in tables], us) for lib in libs]
            for lib in libs[1:]:
                speed = [t[n][lib]["us"] / t[n]["chorus"]["us"] for t in tables]
                row += [ratio(x) for x in speed] if per_run else [spread(speed, ratio).replace("x-", "-")]
            row.append(str(sum(r["wrong"] for t in tables for r in t[n].values())))
            rows.append(row)
        return "\n\n".join([code(bench_command(doc)), table(head, rows),
                            f"{len(docs)} runs, one after the other; {software(doc)}. {files_line(self.paths)}"])


@dataclass
class Summary:
    """Files of one sweep, one per collective: chorus's speed-up over a baseline, a
    column per collective (``by_collective``: a row per collective, some sizes)."""
    paths: list[str]
    baseline: str = "gloo"
    by_collective: bool = False
    sizes: tuple[int, ...] = ()
    with_command: bool = True

    def render(self) -> str:
        docs = [load(p) for p in self.paths]
        names = [d["collective"] for d in docs]
        speed = [{n: e[self.baseline]["us"] / e["chorus"]["us"] for n, e in by_size(d).items()}
                 for d in docs]
        wrong = sum(r["wrong"] for d in docs for r in d["rows"])
        if self.by_collective:
            sizes = list(self.sizes)
            head = ["collective"] + [size(n) for n in sizes]
            rows = [[f"`{name}`"] + [ratio(s[n]) if n in s else "-" for n in sizes]
                    for name, s in zip(names, speed, strict=True)]
        else:
            sizes = sorted(set().union(*speed))
            head = ["size"] + [f"`{name}`" for name in names]
            rows = [[size(n)] + [ratio(s[n]) if n in s else "-" for s in speed] for n in sizes]
        parts = []
        if self.with_command:
            begin = min(d["sizes"][0] for d in docs)
            json_name = f"$c-w{docs[0]['world']}-{docs[0]['baseline']}.json"
            loop = bench_command(docs[0], collective="$c", begin=begin, json_name=json_name)
            for d, name in zip(docs, names, strict=True):  # every file must come from that one loop
                if bench_command(d, collective="$c", begin=begin, json_name=json_name) != loop:
                    raise ValueError(f"{name}: not the loop's command")
            parts.append(f"```bash\nfor c in {' '.join(names)}; do\n  "
                         + wrap(loop).replace("\n", "\n  ") + "\ndone\n```")
        parts.append(table(head, rows))
        checked = "#wrong was 0 in every row" if not wrong else f"{wrong} wrong elements in all"
        parts.append(f"Each cell: {label(docs[0], self.baseline)}'s time over chorus's in the same run "
                     f"(above 1: chorus is faster); {checked}. "
                     f"{software(docs[0])}. {files_line(self.paths)}")
        return "\n\n".join(parts)


@dataclass
class Ddp:
    """``chorus bench-ddp`` runs, a row each: (file, environment the file does not record)."""
    runs: list[tuple[str, dict[str, str]]]

    @staticmethod
    def command(s: dict, env: dict[str, str]) -> str:
        prefix = " ".join(f"{k}={v}" for k, v in {**env, **s.get("malloc", {})}.items())
        parts = [prefix] if prefix else []
        parts += ["chorus bench-ddp", f"--world {s['world']}", f"--batch {s['batch']}", f"--steps {s['steps']}"]
        if s["warmup"] != 3:
            parts.append(f"--warmup {s['warmup']}")
        if (s["features"], s["hidden"]) != (2048, 4096):
            parts.append(f"--features {s['features']} --hidden {s['hidden']}")
        if s.get("bucket_cap_mb") is not None:
            parts.append(f"--bucket-cap-mb {s['bucket_cap_mb']}")
        if s.get("grad_as_bucket_view"):
            parts.append("--grad-as-bucket-view")
        if s["threads"] != max(1, s["cpus"] // s["world"]):
            parts.append(f"--threads {s['threads']}")
        if s.get("transport", "auto") != "auto":
            parts.append(f"--transport {s['transport']}")
        return " ".join(parts)

    def render(self) -> str:
        head = ["run", "compute (ms)", "ddp gloo (ms)", "ddp chorus (ms)", "ddp chorus / gloo",
                "bucket all_reduce chorus / gloo", "losses agree"]
        rows, commands = [], []
        for i, (path, env) in enumerate(self.runs):
            d = load(path)
            v = d["variants"]
            commands.append(self.command(d["settings"], env))
            rows.append([str(i + 1), f"{v['compute']['median'] * 1e3:.1f}", f"{v['ddp gloo']['median'] * 1e3:.1f}",
                         f"{v['ddp chorus']['median'] * 1e3:.1f}", f"{d['ratios']['ddp']['median']:.2f}x",
                         f"{d['ratios']['all_reduce']['median']:.2f}x",
                         f"yes ({d['loss_max_diff']:.1e})" if d["losses_equal"] else "NO"])
        s = load(self.runs[0][0])["settings"]
        listing = "\n".join(f"{i + 1}. `{c}`" for i, c in enumerate(commands))
        return "\n\n".join([listing, table(head, rows),
                            f"Medians over {s['steps']} steps; {s['parameters'] / 1e6:.1f}M parameters, DDP buckets of "
                            + " and ".join(f"{b / 2 ** 20:.0f} MiB" for b in s["buckets"])
                            + f"; {s['cpus']} CPUs, Python {s['host']['python']}, torch {s['torch']}. "
                            + files_line([p for p, _ in self.runs])])


@dataclass
class Gpu:
    """One ``chorus bench --device cuda --json`` run: GPU time per call of chorus (its
    CPU time per call too), NCCL and torch's symmetric-memory kernels where the run had
    them; chorus's and NCCL's bus bandwidth; NCCL's time over chorus's; wrong elements
    (against NCCL's result, every library of the row)."""
    path: str
    command: str  # the command line (the file does not record -b/-e/-f)

    def render(self) -> str:
        doc = load(self.path)
        present = {r["library"] for r in doc["rows"]}
        rows_by = by_gpu_size(doc)
        factor = BUS_FACTOR[doc["collective"]](doc["world"])
        extra = [lib for lib in ("symm-1shot", "symm-2shot") if lib in present]
        names = {"symm-1shot": "symm-mem one-shot (us)", "symm-2shot": "symm-mem two-shot (us)"}
        head = ["size", "chorus (us)", "chorus CPU (us)", "NCCL (us)", "NCCL / chorus"]
        head += [names[lib] for lib in extra] + ["chorus busbw (GB/s)", "NCCL busbw (GB/s)", "#wrong"]
        rows = []
        for n, e in sorted(rows_by.items()):
            c, x = e.get("chorus"), e.get("nccl")
            row = [size(n), us(c["seconds"] * 1e6) if c else "-", us(c["cpu_seconds"] * 1e6) if c else "-",
                   us(x["seconds"] * 1e6) if x else "-", ratio(x["seconds"] / c["seconds"]) if c and x else "-"]
            row += [us(e[lib]["seconds"] * 1e6) if lib in e else "-" for lib in extra]
            row += [f"{n / r['seconds'] * factor / 1e9:.1f}" if r else "-" for r in (c, x)]
            wrong = [r["wrong"] for r in e.values() if r["wrong"] >= 0]
            row.append(str(sum(wrong)) if wrong else "-")
            rows.append(row)
        mode = "calls captured in a CUDA graph and replayed; " if doc.get("graph") else ""
        note = (f"{doc['world']} x {doc['device']}, {doc['dtype']}, torch {doc['torch']}; {mode}{doc['timing']}; "
                f"{doc['iters']} calls per size after {doc['warmup']} warm-up ones"
                + (", fewer above 1 MiB" if doc.get("scale_iters") else "")
                + (f"; each cell the median of {doc['rounds']} rounds" if doc.get("rounds", 1) > 1 else "")
                + ". " + files_line([self.path]))
        return "\n\n".join([code(self.command), table(head, rows), note])


@dataclass
class GpuAlgorithms:
    """One ``chorus bench --device cuda --algorithm a,b,.. --json`` run: GPU time per call
    of each chorus algorithm, and the fastest."""
    path: str
    command: str

    def render(self) -> str:
        doc = load(self.path)
        algos = sorted({r["library"] for r in doc["rows"] if r["library"].startswith("chorus:")})
        head = ["size"] + [f"{a[len('chorus:'):]} (us)" for a in algos] + ["fastest"]
        rows = []
        for n, e in sorted(by_gpu_size(doc).items()):
            got = {a: e[a]["seconds"] for a in algos if a in e}
            rows.append([size(n)] + [us(got[a] * 1e6) if a in got else "-" for a in algos]
                        + [min(got, key=got.get)[len("chorus:"):] if got else "-"])
        note = (f"{doc['world']} x {doc['device']}, {doc['dtype']}, torch {doc['torch']}; GPU time per call on "
                f"rank 0; {doc['iters']} calls per size after {doc['warmup']} warm-up ones. "
                + files_line([self.path]))
        return "\n\n".join([code(self.command), table(head, rows), note])


def by_gpu_size(doc: dict) -> dict[int, dict[str, dict]]:
    """{nbytes: {library: row}} of a ``--device cuda`` file."""
    out: dict[int, dict[str, dict]] = {}
    for r in doc["rows"]:
        out.setdefault(r["nbytes"], {})[r["library"]] = r
    return out


KILO, MEGA = 1 << 10, 1 << 20

TABLES = {
    "w8-summary": Summary([f"{XEON}/{c}-w8-gloo.json" for c in SWEEP_W8]),
    "w8-all_reduce": Nccl(f"{XEON}/all_reduce-w8-gloo.json"),
    "w8-small-all_reduce": Runs([f"{XEON}/all_reduce-small-w8-gloo-openmpi-{i}.json" for i in (1, 2)]),
    # The registered path starts at 1 MiB (below it both kinds of buffer take the same
    # path); this file's settings predate the "registered" field.
    "w8-registered": Nccl(f"{XEON}/all_reduce-w8-gloo-registered.json", min_bytes=MEGA,
                          settings={"registered": True}),
    "w8-ddp": Ddp([(f"{XEON}/ddp-w8-default-1.json", {}), (f"{XEON}/ddp-w8-default-2.json", {}),
                   (f"{XEON}/ddp-w8-private-buckets.json", {"CHORUS_TORCH_SHARE": "0"}),
                   (f"{XEON}/ddp-w8-bucket-view-malloc.json", {})]),
    "w2-mpich": Runs([f"{EPYC}/all_reduce-w2-mpich-{i}.json" for i in (1, 2, 3, 4)]),
    "w8-32-openmpi": Nccl(f"{HOST32}/parity-3/shm-w8.json"),
    "w8-32-openmpi-runs": Runs([f"{HOST32}/shm-w8-openmpi-3runs/shm-w8-mpi-{i}.json" for i in (1, 2, 3)]),
    "w8-32-tcp": Nccl(f"{HOST32}/parity-3/tcp-w8-mpi.json"),
    "w8-16-tcp-exchange": Runs([f"{XEON}/tcp-exchange/all_reduce-tcp-w8-openmpi-{i}.json" for i in (1, 2)]),
    "h200x2-all_to_all": Gpu("2xh200/all_to_all-bf16-w2.json",
                             "NCCL_NVLS_ENABLE=0 chorus bench --device cuda --collective all_to_all -b 1K -e 64M "
                             "-f 8 -n 100 -w 10 --scale-iters"),
    "h200x2-all_gather": GpuAlgorithms("2xh200/all_gather-fused-vs-nccl-bf16-w2.json",
                                       "NCCL_NVLS_ENABLE=0 chorus bench --device cuda --collective all_gather "
                                       "--algorithm fused,nccl -b 1K -e 256M -f 4 -n 100 -w 10 --scale-iters"),
    "h200-all_reduce": Gpu("4xh200/speed-run-6/all_reduce.json",
                           "NCCL_NVLS_ENABLE=0 chorus bench --device cuda --collective all_reduce -b 4 -e 1G -f 4 "
                           "-n 200 -w 20 --scale-iters --lane"),
    "h200-all_reduce-own": Gpu("4xh200/all_reduce-own-kernels-bf16-w4.json",
                               "NCCL_NVLS_ENABLE=0 chorus bench --device cuda --collective all_reduce -b 4 -e 1G "
                               "-f 4 -n 200 -w 20 --scale-iters   # before the NCCL hand-off"),
    "h200-unheld": Gpu("4xh200/speed-run-7/unheld_all_reduce.json",
                       "NCCL_NVLS_ENABLE=0 NCCL_RUNTIME_CONNECT=0 chorus bench --device cuda --collective all_reduce "
                       "-b 8 -e 2M -f 4 --dtype bfloat16 --baseline all -n 300 -w 30 --unheld --rounds 3"),
    "h200-unheld-all_gather": Gpu("4xh200/speed-run-7/unheld_all_gather.json",
                                  "NCCL_NVLS_ENABLE=0 NCCL_RUNTIME_CONNECT=0 chorus bench --device cuda --collective "
                                  "all_gather -b 1K -e 1M -f 4 --dtype bfloat16 --baseline nccl -n 300 -w 30 --unheld "
                                  "--rounds 3"),
    "h200-unheld-reduce_scatter": Gpu("4xh200/speed-run-7/unheld_reduce_scatter.json",
                                      "NCCL_NVLS_ENABLE=0 NCCL_RUNTIME_CONNECT=0 chorus bench --device cuda --collective "
                                      "reduce_scatter -b 1K -e 1M -f 4 --dtype bfloat16 --baseline nccl -n 300 -w 30 "
                                      "--unheld --rounds 3"),
    "h200-held": Gpu("4xh200/speed-run-5/all_reduce-held.json",
                     "NCCL_NVLS_ENABLE=0 chorus bench --device cuda --collective all_reduce "
                     "-b 8 -e 2M -f 4 --dtype bfloat16 --baseline all -n 500 -w 50"),
    "h200-graph": Gpu("4xh200/speed-run-7/graph.json",
                      "NCCL_NVLS_ENABLE=0 chorus bench --device cuda --collective all_reduce -b 4 -e 4M -f 4 "
                      "-n 200 -w 20 --graph --baseline nccl"),
    "h200-nccl-from": GpuAlgorithms("4xh200/calibrate-nccl-bf16-w4.json",
                                    "NCCL_NVLS_ENABLE=0 chorus bench --device cuda --collective all_reduce -b 256K "
                                    "-e 64M -f 2 -n 100 -w 10 --scale-iters --baseline none "
                                    "--algorithm one_shot,two_shot_push,nccl"),
    "h200-all_gather": Gpu("4xh200/speed-run-6/all_gather.json",
                           "NCCL_NVLS_ENABLE=0 chorus bench --device cuda --collective all_gather -b 1K -e 256M "
                           "-f 4 -n 200 -w 20 --scale-iters"),
    "h200-reduce_scatter": Gpu("4xh200/speed-run-6/reduce_scatter.json",
                               "NCCL_NVLS_ENABLE=0 chorus bench --device cuda --collective reduce_scatter -b 1K "
                               "-e 256M -f 4 -n 200 -w 20 --scale-iters"),
    "h200-broadcast": Gpu("4xh200/broadcast-handoff/broadcast.json",
                          "NCCL_NVLS_ENABLE=0 chorus bench --device cuda --collective broadcast -b 1K -e 64M -f 8 "
                          "-n 100 -w 10 --scale-iters"),
    "h200-rails": Gpu("4xh200/speed-run-3/rails.json",
                      "NCCL_NVLS_ENABLE=0 CHORUS_HOST_ID=a,a,b,b CHORUS_CUDA_RAILS=nccl chorus bench --device cuda "
                      "--collective all_reduce -b 16M -e 1G -f 4 -n 50 -w 5 --scale-iters"),
    "h200-calibrate": GpuAlgorithms("4xh200/calibrate-bf16-w4.json",
                                    "NCCL_NVLS_ENABLE=0 chorus bench --device cuda --collective all_reduce -b 16K "
                                    "-e 16M -f 2 -n 200 -w 20 --baseline none --algorithm one_shot,two_shot,copy_reduce"),
    "h200-push": GpuAlgorithms("4xh200/pull-vs-push-bf16-w4.json",
                               "NCCL_NVLS_ENABLE=0 CHORUS_CUDA_TWO_SHOT_PER_THREAD=8 chorus bench --device cuda "
                               "--collective all_reduce -b 1M -e 1G -f 4 -n 100 -w 10 --scale-iters "
                               "--algorithm two_shot,two_shot_push"),
    "readme": Summary([f"{XEON}/{c}-w8-gloo.json" for c in SWEEP_W8], by_collective=True,
                      sizes=(64, KILO, 64 * KILO, MEGA, 4 * MEGA, 16 * MEGA, 256 * MEGA)),
}

BLOCK = re.compile(r"(<!-- table (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def fill(text: str) -> str:
    def replace(m: re.Match) -> str:
        name = m.group("name")
        if name not in TABLES:
            raise KeyError(f"no table {name!r} (known: {', '.join(TABLES)})")
        if "<!-- table " in m.group("body"):
            raise ValueError(f"table {name!r} has no end marker before the next table")
        return m.group(1) + TABLES[name].render() + "\n" + m.group(4)
    return BLOCK.sub(replace, text)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--print":
        for name in argv[1:] or list(TABLES):
            print(f"<!-- table {name} -->\n{TABLES[name].render()}\n<!-- end table -->\n")
        return 0
    if argv and argv[0].endswith(".json"):
        for path in argv:
            print(Nccl(os.path.abspath(path)).render().replace(rel(os.path.abspath(path)), path), "\n")
        return 0
    check = argv == ["--check"]
    if argv and not check:
        print(__doc__, file=sys.stderr)
        return 2
    stale = []
    for page in PAGES:
        with open(page) as f:
            text = f.read()
        new = fill(text)
        if new != text:
            stale.append(os.path.relpath(page, ROOT))
            if not check:
                with open(page, "w") as f:
                    f.write(new)
    if check and stale:
        print(f"out of date: {', '.join(stale)} (run python3 docs/make_tables.py)", file=sys.stderr)
        return 1
    if not check:
        print(f"updated: {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
