"""The model's predictions for H100 clusters of 8 to 4096 GPUs (chorus.sim.gpu), written to
docs/results/model/h100-scale.json, and the tables of docs/scale.md made from that file,
from docs/results/model/published-nccl.json (published NCCL figures, gathered by hand)
and from docs/results/4xh200/all_reduce-own-kernels-bf16-w4.json (NCCL and chorus's own
kernels, measured in this repository).

usage: PYTHONPATH=$PWD python3 tools/predict_scale.py           write the result file and the page's tables
       PYTHONPATH=$PWD python3 tools/predict_scale.py --check   exit 1 if either differs from what the model gives now
       PYTHONPATH=$PWD python3 tools/predict_scale.py --print   print the tables only

A table sits between ``<!-- table NAME -->`` and ``<!-- end table -->`` in the page, as
for docs/make_tables.py, whose formatting helpers this script uses.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from dataclasses import asdict

from chorus.sim.gpu import GpuTopology, estimate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = os.path.join(ROOT, "docs", "results", "model", "h100-scale.json")
PUBLISHED = os.path.join(ROOT, "docs", "results", "model", "published-nccl.json")
MEASURED = os.path.join(ROOT, "docs", "results", "4xh200", "all_reduce-own-kernels-bf16-w4.json")
PAGE = os.path.join(ROOT, "docs", "scale.md")
COMMAND = "PYTHONPATH=$PWD python3 tools/predict_scale.py"

_spec = importlib.util.spec_from_file_location("make_tables", os.path.join(ROOT, "docs", "make_tables.py"))
make_tables = sys.modules["make_tables"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_tables)
size, table, BLOCK = make_tables.size, make_tables.table, make_tables.BLOCK

GPUS = tuple(8 << k for k in range(10))       # 8 .. 4096: 1 .. 512 hosts of 8
SIZES = tuple(8 << k for k in range(32))      # 8 B .. 16 GiB
#: Link rates: the hardware's, and what NCCL reaches on each link (docs/scale.md, sources
#: S1 and S3: 370 GB/s effective NVLink, 48 GB/s per 400 Gb/s NIC).
RATES = {"line": {}, "nccl": {"nvlink_bandwidth": 370e9, "nic_bandwidth": 48e9}}
VARIANTS = {  # collective -> (name in the file, algorithm, options)
    c: [("ring", "ring", {})] + ([("tree", "tree", {})] if c == "all_reduce" else [])
    + [("hierarchical", "hierarchical", {}), ("hierarchical+overlap", "hierarchical", {"overlap": True})]
    for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
}


def cluster(gpus: int, rates: str) -> GpuTopology:
    return GpuTopology.h100(hosts=gpus // 8, **RATES[rates])


def sweep() -> dict:
    """Every (rates, collective, variant, GPU count): seconds for each size, and for the
    hierarchical variants the rail algorithm taken at each size."""
    rows = []
    for rates in RATES:
        for collective, variants in VARIANTS.items():
            for name, algorithm, options in variants:
                for gpus in GPUS:
                    t = cluster(gpus, rates)
                    got = [estimate(collective, algorithm, t, n, **options) for n in SIZES]
                    row = {"rates": rates, "collective": collective, "variant": name, "gpus": gpus,
                           "seconds": [float(f"{e.seconds:.5g}") for e in got]}
                    if algorithm == "hierarchical" and t.hosts > 1:
                        row["rails"] = [_rail(e.choices) for e in got]
                    rows.append(row)
    h100 = {k: v for k, v in asdict(GpuTopology.h100(hosts=1)).items() if k != "hosts"}
    return {"command": COMMAND, "model": "chorus.sim.gpu.estimate",
            "topology": "GpuTopology.h100(hosts=gpus // 8, **rates)", "h100": h100,
            "rates": RATES, "sizes": list(SIZES), "gpus": list(GPUS), "rows": rows}


def _rail(choices: tuple[str, ...]) -> str:
    return next(c.split()[1] for c in choices if c.startswith("rail "))


# --- tables ----------------------------------------------------------------------------

class Results:
    def __init__(self, doc: dict):
        self.doc = doc
        self.rows = {(r["rates"], r["collective"], r["variant"], r["gpus"]): r for r in doc["rows"]}

    def seconds(self, collective, variant, gpus, nbytes, rates="line") -> float:
        return self.rows[(rates, collective, variant, gpus)]["seconds"][SIZES.index(nbytes)]

    def busbw(self, collective, variant, gpus, nbytes, rates="line") -> float:
        """GB/s as nccl-tests computes it from the time."""
        factor = {"all_reduce": 2 * (gpus - 1) / gpus, "broadcast": 1.0}.get(collective, (gpus - 1) / gpus)
        return nbytes / self.seconds(collective, variant, gpus, nbytes, rates) * factor / 1e9

    def rail(self, collective, variant, gpus, nbytes, rates="line") -> str:
        return self.rows[(rates, collective, variant, gpus)].get("rails", ["-"] * len(SIZES))[SIZES.index(nbytes)]


def _fmt(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _per_gpus(res: Results, collective: str, cell, variants=None) -> str:
    names = variants or [v[0] for v in VARIANTS[collective]]
    head = ["GPUs (hosts)"] + names
    rows = [[f"{g} ({g // 8})"] + [cell(v, g) for v in names] for g in GPUS]
    return table(head, rows)


def _best_flat(res: Results, collective: str, gpus: int, nbytes: int) -> float:
    flat = [v for v in ("ring", "tree") if (v in [x[0] for x in VARIANTS[collective]])]
    return min(res.seconds(collective, v, gpus, nbytes) for v in flat)


def render(doc: dict, published: dict, measured: dict) -> dict[str, str]:
    res = Results(doc)
    small, mid, large = 8, 16 << 20, 16 << 30
    t = {}
    t["scale-allreduce-small"] = _per_gpus(
        res, "all_reduce", lambda v, g: f"{res.seconds('all_reduce', v, g, small) * 1e6:.1f}"
        + (f" ({res.rail('all_reduce', v, g, small)})" if v.startswith("hier") and g > 8 else ""))
    for name, nbytes in (("scale-allreduce-mid", mid), ("scale-allreduce-large", large)):
        t[name] = _per_gpus(res, "all_reduce", lambda v, g, n=nbytes: _fmt(res.busbw("all_reduce", v, g, n)))
    for coll in ("all_gather", "broadcast"):
        t[f"scale-{coll}"] = _per_gpus(
            res, coll, lambda v, g, c=coll: f"{res.seconds(c, v, g, small) * 1e6:.1f} us, "
            f"{_fmt(res.busbw(c, v, g, mid))}, {_fmt(res.busbw(c, v, g, large))}")
    t["scale-nccl-rates"] = _per_gpus(
        res, "all_reduce", lambda v, g: f"{_fmt(res.busbw('all_reduce', v, g, mid, 'nccl'))}, "
        f"{_fmt(res.busbw('all_reduce', v, g, large, 'nccl'))}")
    for coll in ("all_reduce", "all_gather", "broadcast"):
        t[f"scale-ratio-{coll}"] = _ratios(res, coll)
    t["scale-published"] = _published(published, measured)
    t["scale-sources"] = table(["", "source", "who, when", "what it says"],
                               [[s["id"], s["url"], s["who"], s["says"]] for s in published["sources"]],
                               right_from=99)
    return t


RATIO_SIZES = (8, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 16 << 30)


def _ratios(res: Results, collective: str) -> str:
    """The best flat algorithm's time over the hierarchical one's: above 1, the hierarchy
    is faster; each cell shows it with the phases in sequence / overlapped."""
    head = ["GPUs"] + [size(n) for n in RATIO_SIZES]
    rows = []
    for g in GPUS:
        cells = []
        for n in RATIO_SIZES:
            flat = _best_flat(res, collective, g, n)
            cells.append(" / ".join(f"{flat / res.seconds(collective, v, g, n):.2f}"
                                    for v in ("hierarchical", "hierarchical+overlap")))
        rows.append([str(g)] + cells)
    return table(head, rows)


def _model_for(fig: dict) -> tuple[str, str]:
    """The model's figure for a published one, at line rates and at NCCL's link rates."""
    if not fig.get("model"):
        return "not modelled", "not modelled"
    spec = fig["system"]
    hosts = spec.get("hosts") or 2          # several hosts, the number not given
    nbytes = fig.get("nbytes") or SIZES[-1]  # the source's largest sizes: the page's largest
    out = []
    for rates in ("line", "nccl"):
        links = {k: spec[k] for k in ("nvlink_bandwidth", "nic_bandwidth", "nics_per_host",
                                      "gpus_per_host") if k in spec}
        if rates == "nccl":
            links.update({k: v for k, v in spec.get("nccl_rates", RATES["nccl"]).items()})
        e = estimate(fig["collective"], fig["model"], GpuTopology.h100(hosts=hosts, **links), nbytes)
        out.append(f"{e.busbw / 1e9:.0f} GB/s" if fig["metric"] == "busbw" else f"{e.seconds * 1e6:.1f} us")
    return out[0], out[1]


def _published(published: dict, measured: dict) -> str:
    head = ["", "system", "collective, algorithm", "size", "published", "model (line rates)",
            "model (NCCL's link rates)"]
    rows = []
    for fig in published["figures"] + _measured_figures(measured):
        value = fig["value"]
        unit = "GB/s" if fig["metric"] == "busbw" else "us"
        shown = f"{value[0]}-{value[1]} {unit}" if isinstance(value, list) else f"{value} {unit}"
        line, nccl = _model_for(fig)
        rows.append([fig["source"], fig["system"]["text"], f"{fig['collective']}, {fig['nccl_algorithm']}",
                     size(fig["nbytes"]) if fig.get("nbytes") else "largest", shown, line, nccl])
    return table(head, rows, right_from=4)


def _measured_figures(measured: dict) -> list[dict]:
    """NCCL's and chorus's all_reduce on 4 H200 of one host, from this repository's result
    file; chorus's is the model's hierarchical algorithm on one host."""
    w = measured["world"]
    system = {"text": f"1 host x {w} {measured['device'].split()[-1]} (NVLink taken as H100's)",
              "hosts": 1, "gpus_per_host": w}
    figs = []
    for library, model in (("nccl", "ring"), ("chorus", "hierarchical")):
        got = {r["nbytes"]: r["seconds"] for r in measured["rows"] if r["library"] == library}
        what = "NCCL's choice, NVLS off" if library == "nccl" else "chorus (in-host component)"
        for nbytes in (16, 1 << 20, 16 << 20, 1 << 30):
            busbw = nbytes >= 1 << 30
            value = round(nbytes / got[nbytes] * 2 * (w - 1) / w / 1e9) if busbw \
                else round(got[nbytes] * 1e6, 1)
            figs.append({"source": "M1", "system": system, "collective": "all_reduce",
                         "nccl_algorithm": what, "nbytes": nbytes, "value": value,
                         "metric": "busbw" if busbw else "time", "model": model})
    return figs


# --- files -----------------------------------------------------------------------------

def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _dump(doc: dict) -> str:
    """JSON with one line per row of predictions."""
    head = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items() if k != "rows"]
    rows = ",\n".join(f"  {json.dumps(r)}" for r in doc["rows"])
    return "{\n" + ",\n".join(head) + ',\n "rows": [\n' + rows + "\n ]\n}\n"


def fill(text: str, tables: dict[str, str]) -> str:
    def replace(m: re.Match) -> str:
        if m.group("name") not in tables:
            raise KeyError(f"docs/scale.md names table {m.group('name')!r}; known: {', '.join(tables)}")
        return m.group(1) + tables[m.group("name")] + "\n" + m.group(4)
    return BLOCK.sub(replace, text)


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"], ["--print"]):
        print(__doc__, file=sys.stderr)
        return 2
    doc = sweep()
    text = _dump(doc)
    tables = render(doc, _load(PUBLISHED), _load(MEASURED))
    if argv == ["--print"]:
        for name, body in tables.items():
            print(f"<!-- table {name} -->\n{body}\n<!-- end table -->\n")
        return 0
    with open(PAGE) as f:
        page = f.read()
    new_page = fill(page, tables)
    old_text = open(RESULT).read() if os.path.exists(RESULT) else ""
    stale = [os.path.relpath(p, ROOT) for p, old, new in
             ((RESULT, old_text, text), (PAGE, page, new_page)) if old != new]
    if argv == ["--check"]:
        if stale:
            print(f"out of date: {', '.join(stale)} (run {COMMAND})", file=sys.stderr)
            return 1
        return 0
    os.makedirs(os.path.dirname(RESULT), exist_ok=True)
    with open(RESULT, "w") as f:
        f.write(text)
    with open(PAGE, "w") as f:
        f.write(new_page)
    print(f"updated: {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
