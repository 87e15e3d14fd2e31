"""``chorus bench --device cuda`` without a GPU: its dry mode (CHORUS_BENCH_CUDA_DRY=1)
runs the same rank code on CPU tensors with gloo standing in for NCCL; the table and the
JSON come out as on GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(*args, env=None):
    env = dict(os.environ, CHORUS_BENCH_CUDA_DRY="1", PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, "-c", "import sys; from chorus.cli import main; sys.exit(main())",
                           "bench", "--device", "cuda", *args], capture_output=True, text=True, env=env,
                          timeout=240)


@pytest.mark.parametrize("collective", ["all_reduce"])
def test_dry_run_table_and_json(tmp_path, collective):
    out = tmp_path / "r.json"
    p = bench("--collective", collective, "-b", "1K", "-e", "16K", "-f", "16", "-n", "3", "-w", "1",
              "--world", "1", "--json", str(out))  # (one rank: the table's code is the same)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "| x nccl" in p.stdout.replace("  ", " ") or "x nccl" in p.stdout
    doc = json.loads(out.read_text())
    libs = {(r["library"], r["nbytes"]) for r in doc["rows"]}
    assert libs == {(lib, n) for lib in ("chorus", "nccl") for n in (1024, 16384)}
    assert all(r["wrong"] == 0 and r["seconds"] > 0 and r["cpu_seconds"] > 0 for r in doc["rows"])


def test_rounds_give_medians_and_the_range_of_each_round(tmp_path):
    """--rounds 2: the sweep twice in the same ranks; the table's times are the medians,
    a second table gives the lowest-highest of NCCL's time over chorus's across the rounds
    (and how many were below 1), and the JSON keeps every round's rows."""
    out = tmp_path / "r.json"
    p = bench("--collective", "all_reduce", "-b", "1K", "-e", "4K", "-f", "4", "-n", "3", "-w", "1",
              "--world", "1", "--rounds", "2", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 rounds" in p.stdout and "each of the 2 rounds" in p.stdout and "of 2 below 1)" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["rounds"] == 2 and len(doc["rows"]) == 4 and len(doc["rows_by_round"]) == 8
    for row in doc["rows"]:
        mine = sorted(r["seconds"] for r in doc["rows_by_round"]
                      if (r["library"], r["nbytes"]) == (row["library"], row["nbytes"]))
        assert row["seconds"] == pytest.approx(sum(mine) / 2)  # (the median of two)


def test_merge_counts_wrong_elements_per_round_and_rounds_skip_the_unchecked(tmp_path):
    """Two ranks, two rounds: each round's row carries the wrong elements of both ranks in
    that round (not of every round); a round that could not be checked (-1) does not
    hide another round's wrong elements."""
    from chorus.bench.cuda_report import median_rows, merge

    def row(lib, rnd, wrong):
        return dict(library=lib, nbytes=1024, count=256, seconds=1e-5, cpu_seconds=1e-5, wrong=wrong, round=rnd)

    for rank, wrongs in ((0, (1, 0)), (1, (2, -1))):
        rows = [row("chorus", rnd, w) for rnd, w in enumerate(wrongs)]
        (tmp_path / f"rows-{rank}.json").write_text(json.dumps({"rows": rows, "notes": [f"note {rank}"]}))
    rows, notes = merge(str(tmp_path), 2)
    assert [r["wrong"] for r in rows] == [3, -1] and notes == ["note 0", "note 1"]
    medians, _ = median_rows(rows)
    assert [(r["wrong"], "round" in r) for r in medians] == [(3, False)]
    assert median_rows([dict(rows[1])])[0][0]["wrong"] == -1


def test_median_rows_and_round_ranges():
    from chorus.bench.cuda_report import format_round_ranges, median_rows

    def row(lib, us, wrong=0):
        return dict(library=lib, nbytes=1024, count=256, seconds=us * 1e-6, cpu_seconds=us * 1e-6, wrong=wrong)

    rows, times = median_rows([row("chorus", 10), row("nccl", 30), row("chorus", 20), row("nccl", 15, wrong=2),
                               row("chorus", 12), row("nccl", 36)])
    assert {r["library"]: (round(r["seconds"] * 1e6, 3), r["wrong"]) for r in rows} == {"chorus": (12.0, 0),
                                                                                         "nccl": (30.0, 2)}
    assert "0.75-3.00x (1 of 3 below 1)" in format_round_ranges(times)
    # every library dropped, or chorus's algorithms alone (--baseline none): said, not a traceback
    nothing = "(no results of both chorus and a baseline to compare round by round)"
    assert format_round_ranges({}) == nothing
    assert format_round_ranges({("chorus:one_shot", 1024): [1e-5], ("chorus:nccl", 1024): [2e-5]}) == nothing
    assert format_round_ranges({("nccl", 1024): [1e-5]}) == nothing


def test_format_table_and_iterations():
    from chorus.bench import cuda

    rows = [dict(library="chorus", nbytes=1 << 20, count=1 << 19, seconds=10e-6, cpu_seconds=5e-6, wrong=0),
            dict(library="nccl", nbytes=1 << 20, count=1 << 19, seconds=40e-6, cpu_seconds=8e-6, wrong=0)]
    table = cuda.format_table(rows, "all_reduce", 4, "bfloat16")
    assert "4.00x" in table and "1M" in table
    assert cuda.iterations(100, 10, 1 << 30, True) == (5, 2)
    assert cuda.iterations(100, 10, 1 << 10, True) == (100, 10)


@pytest.mark.parametrize("args", [["--collective", "reduce"], ["--dtype", "int16"]])
def test_bad_arguments(args, monkeypatch):
    """Refused before any rank starts (exit status 2, as argparse's)."""
    from chorus.cli import main

    monkeypatch.setenv("CHORUS_BENCH_CUDA_DRY", "1")
    try:
        code = main(["bench", "--device", "cuda", *args])
    except SystemExit as exc:
        code = exc.code
    assert code == 2


def test_bind_puts_every_thread_of_a_rank_on_its_gpu_s_cpus(tmp_path, monkeypatch):
    """``--bind gpu``: the kernel's CPU list of the GPU's PCI device (domain:bus:device.0),
    as far as this process may use them, for every thread the process has; a GPU the
    system lists no CPUs for, or a torch without the PCI address, is left unbound and
    says why."""
    from types import SimpleNamespace

    from chorus.bench import cuda as bench_cuda
    from chorus.host import cpus

    device = tmp_path / "0000:1b:00.0"
    device.mkdir()
    (device / "local_cpulist").write_text("0-3,8,10-11\n")
    assert cpus.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpus.format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11" and cpus.format_cpulist({5}) == "5"
    assert cpus.pci_local_cpus(0, 0x1B, 0, root=str(tmp_path)) == {0, 1, 2, 3, 8, 10, 11}
    assert cpus.pci_local_cpus(0, 0x1C, 0, root=str(tmp_path)) is None
    monkeypatch.setattr(cpus, "pci_local_cpus", lambda *ids: cpus.parse_cpulist("0-3,8,10-11")
                        if ids == (0, 0x1B, 0) else None)
    monkeypatch.setattr(cpus, "affinity", lambda: set(range(10)))
    bound: list = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, allowed: bound.append((pid, set(allowed))))
    props = {0: SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0),
             1: SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1C, pci_device_id=0), 2: SimpleNamespace()}
    torch = SimpleNamespace(cuda=SimpleNamespace(get_device_properties=props.__getitem__), __version__="2.0")
    before = {int(t) for t in os.listdir("/proc/self/task")}
    assert bench_cuda._bind(torch, 0) == "rank 0: bound to the CPUs local to GPU 0: 0-3,8"
    lasting = before & {int(t) for t in os.listdir("/proc/self/task")}
    assert os.getpid() in lasting and lasting <= {pid for pid, _ in bound}
    assert all(cpu_set == {0, 1, 2, 3, 8} for _, cpu_set in bound)
    bound.clear()
    assert "not bound (the system lists no CPUs" in bench_cuda._bind(torch, 1)
    assert "not bound (torch 2.0 does not give" in bench_cuda._bind(torch, 2) and bound == []


def test_bind_exclusive_splits_a_gpu_s_cores_among_the_ranks_sharing_them(tmp_path, monkeypatch):
    """``--bind exclusive``: ranks whose GPUs list the same CPUs take runs of whole
    physical cores in rank order (a core's hardware threads stay together; the first
    ranks one core more where the cores do not divide evenly); a GPU with CPUs of its own
    keeps them all; overlapping lists are named; fewer cores than sharing ranks leaves the
    rank unbound, saying so."""
    from types import SimpleNamespace

    from chorus.bench import cuda as bench_cuda
    from chorus.host import cpus

    for cpu in range(16):  # CPUs 0-7 are cores 0-7; 8-15 their second hardware threads
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(f"{cpu % 8},{cpu % 8 + 8}\n")
    assert cpus.cores({0, 1, 8, 9, 20}, root=str(tmp_path)) == [[0, 8], [1, 9], [20]]
    real_cores = cpus.cores
    monkeypatch.setattr(cpus, "cores", lambda cpu_set: real_cores(cpu_set, root=str(tmp_path)))
    shared = set(range(7)) | set(range(8, 15))  # 7 cores, both threads of each
    local = {0x1B: shared, 0x1C: shared, 0x1D: shared, 0x2A: {20, 21}}
    monkeypatch.setattr(cpus, "pci_local_cpus", lambda domain, bus, device: set(local[bus]))
    monkeypatch.setattr(cpus, "affinity", lambda: set(range(64)))
    bound: dict = {}
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, allowed: bound.__setitem__("cpus", set(allowed)))
    buses = [0x1B, 0x2A, 0x1C, 0x1D]
    props = [SimpleNamespace(pci_domain_id=0, pci_bus_id=b, pci_device_id=0) for b in buses]
    torch = SimpleNamespace(cuda=SimpleNamespace(get_device_properties=props.__getitem__), __version__="2.0")
    got, notes = {}, {}
    for rank in range(4):
        notes[rank] = bench_cuda._bind(torch, rank, 4, exclusive=True)
        got[rank] = bound.pop("cpus")
    assert got == {0: {0, 8, 1, 9, 2, 10}, 1: {20, 21}, 2: {3, 11, 4, 12}, 3: {5, 13, 6, 14}}
    assert notes[1] == "rank 1: bound to the CPUs local to GPU 1: 20-21"
    assert notes[2] == "rank 2: bound to its 2 of the 7 cores local to GPU 2: 3-4,11-12"
    local[0x2A] = {6, 14, 30}  # overlaps the others' list without being equal to it
    assert bench_cuda._bind(torch, 0, 4, exclusive=True).endswith("other GPUs' CPU lists overlap these, so "
                                                                   "shares may too")
    local[0x1B] = local[0x1C] = local[0x1D] = {0, 8, 1, 9}
    assert bench_cuda._bind(torch, 3, 4, exclusive=True) == "rank 3: not bound (2 cores local to GPU 3 for 3 ranks)"


def test_bind_reaches_the_ranks_and_is_refused_on_cpus(monkeypatch):
    """A dry run's ranks are asked to bind (and say they cannot: no GPU); ``--bind`` of
    the CPU bench is refused before anything starts."""
    p = bench("--collective", "all_reduce", "-b", "1K", "-e", "1K", "-n", "2", "-w", "1", "--world", "1",
              "--bind", "gpu")
    assert p.returncode == 0 and "rank 0: not bound (a dry run has no GPU)" in p.stdout, p.stdout + p.stderr
    from chorus.cli import main

    try:
        code = main(["bench", "--bind", "gpu", "--world", "2"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
