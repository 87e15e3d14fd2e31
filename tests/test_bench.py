"""``chorus bench``: sizes, cases, the table, JSON, the plot, progress lines, --help,
exit codes, and real runs of chorus alone and against MPI (mpi4py + mpiexec, e.g.
``pip install mpich mpi4py``)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from chorus.bench import cli as bench_cli
from chorus.bench import mpi_worker, progress
from chorus.bench.ops import (
    COLLECTIVES,
    check_op,
    counts,
    make_buffers,
    pattern,
    sweep_counts,
)
from chorus.bench.report import (
    Row,
    format_rounds,
    format_table,
    medians,
    merge_ranks,
    speedups,
    to_json,
)
from chorus.bench.sizes import human, parse_size, sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
MPIEXEC = mpi_worker.find_mpiexec()
NO_MPI = mpi_worker.unavailable(MPIEXEC)


def _bench(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "chorus.cli", "bench", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _table_rows(stdout: str) -> list[list[str]]:
    """The table's data lines, split into cells by '|' (the header and rule dropped)."""
    lines = [ln for ln in stdout.splitlines() if ln and not ln.startswith("#")]
    assert lines[0].split("|")[0].split() == ["size"] and lines[0].split()[-1] == "#wrong", stdout
    assert all(len(ln) <= bench_cli.WIDTH for ln in stdout.splitlines()), stdout
    return [[c.strip() for c in ln.split("|")] for ln in lines[2:]]


def _comments(stdout: str) -> str:
    """The ``#`` lines as one text (the lines a long note was wrapped into joined again)."""
    return " ".join(ln[1:].strip() for ln in stdout.splitlines() if ln.startswith("#"))


# -- sizes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("0", 0), ("8", 8), ("1K", 1024), ("1k", 1024), ("1KB", 1024), ("1KiB", 1024), ("64M", 64 << 20),
    ("256M", 256 << 20), ("2G", 2 << 30), (" 4 ", 4), ("1.5K", 1536), ("8B", 8), ("1e3", 1000),
])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "B", "K", "KB", "-1", "-1K", "0.5", "1.3K", "inf", "nan", "1T",
                                  "abc", "1KK", "8 bytes"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="bad size"):
        parse_size(text)


def test_sweep_edges():
    assert sweep(8, 64, 2) == [8, 16, 32, 64]
    assert sweep(8, 8, 2) == [8]
    assert sweep(8, 100, 4) == [8, 32]  # the end is inclusive, not forced
    assert sweep(0, 4, 2) == [0, 1, 2, 4]
    assert sweep(0, 0, 2) == [0]
    assert sweep(3, 300, 10) == [3, 30, 300]
    with pytest.raises(ValueError, match="at least 2"):
        sweep(8, 64, 1)
    with pytest.raises(ValueError, match="larger than"):
        sweep(1 << 20, 1024, 2)


def test_human():
    assert [human(n) for n in (0, 4, 1000, 1024, 1536, 1 << 20, 256 << 20, 1 << 30)] == \
        ["0", "4", "1000", "1K", "1536", "1M", "256M", "1G"]


def test_sweep_counts_whole_elements_and_blocks():
    sizes = sweep(1, 64, 2)  # 1 2 4 8 16 32 64 bytes
    assert sweep_counts(sizes, "all_reduce", 4, 4) == [1, 2, 4, 8, 16]  # 1-3 bytes: no element
    assert sweep_counts(sizes, "all_gather", 4, 4) == [4, 8, 16]  # a multiple of the world
    assert sweep_counts([4, 12, 16], "all_to_all", 3, 1) == [3, 12, 15]
    assert sweep_counts([8, 9, 10, 11, 12], "sendrecv", 2, 4) == [2, 3]  # no repeated size
    assert sweep_counts(sizes, "barrier", 4, 4) == [0]
    assert sweep_counts([2], "reduce_scatter", 4, 4) == []


def test_check_op():
    assert check_op("all_reduce", "sum", "float32") is None
    assert check_op("broadcast", "band", "float32") is None  # op unused
    assert "not defined" in check_op("all_reduce", "band", "float32")
    assert "not defined" in check_op("reduce", "avg", "int32")
    assert "dtype" in check_op("all_reduce", "sum", "bfloat16")


# -- cases: the expected results agree with a plain numpy model of each collective ------

def _simulate(collective: str, op: str, world: int, count: int, dtype: str) -> list[np.ndarray | None]:
    """What each rank's checked buffer holds after a correct collective (None: unchecked)."""
    n_in, n_out = counts(collective, count, world)
    ins = [pattern(r, n_in, dtype) for r in range(world)]
    fn = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum, "avg": np.add,
          "bxor": np.bitwise_xor}[op]
    red = ins[0].copy()
    for x in ins[1:]:
        red = fn(red, x, dtype=dtype)
    if op == "avg":
        red = (red / world).astype(dtype)
    b = n_out // world
    return {
        "all_reduce": [red] * world,
        "reduce": [red] + [None] * (world - 1),
        "broadcast": [ins[0]] * world,
        "all_gather": [np.concatenate(ins)] * world,
        "reduce_scatter": [red[r * n_out:(r + 1) * n_out] for r in range(world)],
        "all_to_all": [np.concatenate([ins[s][r * b:(r + 1) * b] for s in range(world)]) for r in range(world)],
        "sendrecv": [ins[(r - 1) % world] for r in range(world)],
        "barrier": [None] * world,
    }[collective]


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("op, dtype", [("sum", "float32"), ("prod", "float64"), ("avg", "float32"),
                                       ("max", "int8"), ("bxor", "int64"), ("prod", "int32")])
def test_buffers_check_against_a_model(collective, op, dtype):
    world, count = 3, 12
    for rank, want in enumerate(_simulate(collective, op, world, count, dtype)):
        bufs = make_buffers(collective, count, dtype, rank, world, op)
        if want is None:
            assert bufs.check() == 0
            continue
        bufs.checked[...] = want
        assert bufs.check() == 0, (collective, op, dtype, rank)
        bufs.checked[1] += 1  # one wrong element
        assert bufs.check() == 1
        bufs.reset()
        assert np.array_equal(bufs.inp, pattern(rank, bufs.inp.size, dtype))


# -- the table, merging, JSON --------------------------------------------------------------

def _row(lib, nbytes, us, wrong=0, collective="all_reduce", world=2):
    return Row(lib, collective, nbytes, nbytes // 4, "float32", "sum", us / 1e6, wrong, world)


def test_format_table_columns_and_speedups():
    rows = [_row("mpi", 1024, 50.0, wrong=1), _row("gloo", 8, 300.0), _row("chorus", 8, 100.0),
            _row("chorus", 1024, 100.0, wrong=2), _row("gloo", 1024, 400.0)]
    text = format_table(rows)
    head, rule, *lines = text.splitlines()
    assert [c.split() for c in head.split("|")] == [
        ["size"], ["chorus", "us", "busbw"], ["gloo", "us", "busbw"], ["mpi", "us", "busbw"],
        ["vs", "gloo", "vs", "mpi"], ["#wrong"]]
    assert set(rule) == {"-"} and len(rule) == len(head) <= bench_cli.WIDTH
    assert all(len(ln) == len(head) for ln in lines)
    small, big = ([c.strip() for c in ln.split("|")] for ln in lines)
    assert small[:3] == ["8", "100.0   0.00", "300.0   0.00"]
    assert small[3:] == ["-      -", "3.00x        -", "0"]  # mpi has no 8-byte row
    assert big[0] == "1K" and big[1].split() == ["100.0", "0.01"]
    assert big[4:] == ["4.00x    0.50x", "3"]  # #wrong: chorus's 2 and mpi's 1


def test_the_table_fits_100_columns_with_two_baselines_at_every_size():
    rows = [_row(lib, n, us * f, wrong=12345) for lib, f in (("chorus", 1.0), ("gloo", 300.0), ("mpi", 90.0))
            for n, us in ((0, 1.0), (4, 1.0), (1536, 10.0), (256 << 20, 30000.0), (1 << 30, 99000.0))]
    assert max(len(ln) for ln in format_table(rows).splitlines()) <= bench_cli.WIDTH


def test_help_shows_the_defaults():
    parser = bench_cli.argparse.ArgumentParser(prog="chorus bench", formatter_class=bench_cli.HelpFormatter)
    bench_cli.add_arguments(parser)
    shown = " ".join(parser.format_help().split())
    for default in ("(default: 8)", "(default: 64M)", "(default: 20)", "(default: 5)", "(default: auto)",
                    "(default: all_reduce)", "(default: cpu)"):
        assert default in shown, default
    assert "(default: None)" not in shown and "(default: False)" not in shown
    assert "default float32" in shown and "default 2" in shown  # said by the options themselves


# -- progress ------------------------------------------------------------------------------

def test_progress_prints_a_size_once_every_job_finished_it(tmp_path):
    out = io.StringIO()
    shown = progress.Progress(str(tmp_path), ["chorus", "mpi"], [8, 1024, 4096], stream=out, live=False)
    progress.record(str(tmp_path), "chorus", 1, {"chorus": 10e-6, "gloo": 30e-6})
    shown.poll()
    assert out.getvalue() == ""  # mpi has not finished size 1 yet
    progress.record(str(tmp_path), "mpi", 1, {"mpi": 20e-6})
    progress.record(str(tmp_path), "chorus", 2, {"chorus": 10e-6, "gloo": 10e-6})
    with open(tmp_path / "progress-chorus.jsonl", "a") as f:
        f.write('{"index": 3, "seco')  # a record still being written is left for later
    shown.poll()
    line, = out.getvalue().splitlines()
    assert line.startswith("# [1/3] 8: chorus 10.0 us, gloo 30.0 us (3.00x), mpi 20.0 us (2.00x); "), line
    shown.drop("mpi")  # the MPI job failed: the sizes no longer wait for it
    assert out.getvalue().splitlines()[1].startswith("# [2/3] 1K: chorus 10.0 us, gloo 10.0 us (1.00x); ")
    shown.close()
    assert len(out.getvalue().splitlines()) == 2


def test_progress_on_a_terminal_rewrites_one_line_and_clears_it(tmp_path):
    out = io.StringIO()
    shown = progress.Progress(str(tmp_path), ["chorus"], [8, 16], stream=out, live=True)
    shown.waiting("starting 2 ranks ...")
    progress.record(str(tmp_path), "chorus", 1, {"chorus": 1e-6})
    progress.record(str(tmp_path), "chorus", 2, {"chorus": 2e-6})
    shown.close()
    text = out.getvalue()
    assert "\n" not in text and text.endswith("\r\033[K")
    assert [part for part in text.split("\r\033[K") if part][0] == "starting 2 ranks ..."
    assert [part.split(";")[0] for part in text.split("\r\033[K") if part][1:] == [
        "[1/2] 8: chorus 1.0 us", "[2/2] 16: chorus 2.0 us"]


def test_busbw_factors():
    assert _row("chorus", 1000, 1.0, world=4).algbw == pytest.approx(1.0)
    assert _row("chorus", 1000, 1.0, world=4).busbw == pytest.approx(1.5)
    assert _row("chorus", 1000, 1.0, collective="all_gather", world=4).busbw == pytest.approx(0.75)
    assert _row("chorus", 1000, 1.0, collective="broadcast", world=4).busbw == pytest.approx(1.0)


def test_merge_ranks_takes_rank0_time_and_every_wrong():
    merged = merge_ranks({0: [_row("chorus", 8, 10.0, wrong=0)], 1: [_row("chorus", 8, 99.0, wrong=3)]})
    assert len(merged) == 1 and merged[0].seconds == pytest.approx(10e-6) and merged[0].wrong == 3


def test_rounds_merge_per_round_then_take_medians_and_speedup_ranges():
    """Two ranks, two rounds: each round's rank-0 time and its own wrong count; then the
    median per (library, size), the wrong elements of every round, the per-round ratios."""
    per_rank = {0: [_row("chorus", 8, 10.0), _row("gloo", 8, 30.0), _row("chorus", 8, 20.0, wrong=1),
                    _row("gloo", 8, 50.0), _row("chorus", 8, 40.0), _row("gloo", 8, 40.0)],
                1: [_row("chorus", 8, 99.0, wrong=2), _row("gloo", 8, 99.0), _row("chorus", 8, 99.0),
                    _row("gloo", 8, 99.0), _row("chorus", 8, 99.0), _row("gloo", 8, 99.0)]}
    merged = merge_ranks(per_rank)
    assert [(r.library, round(r.seconds * 1e6), r.wrong) for r in merged] == [
        ("chorus", 10, 2), ("gloo", 30, 0), ("chorus", 20, 1), ("gloo", 50, 0), ("chorus", 40, 0), ("gloo", 40, 0)]
    rows, times = medians(merged)
    assert [(r.library, round(r.seconds * 1e6), r.wrong) for r in rows] == [("chorus", 20, 3), ("gloo", 40, 0)]
    assert times[("gloo", 8)] == pytest.approx([30e-6, 50e-6, 40e-6])
    table = format_rounds(times)
    assert table.splitlines()[2].split() == ["8", "|", "1.00-3.00x", "(3)"]  # 3.0, 2.5, 1.0
    doc = to_json(rows, {}, times)
    chorus_row = next(r for r in doc["rows"] if r["library"] == "chorus")
    assert chorus_row["rounds_us"] == pytest.approx([10.0, 20.0, 40.0])
    assert chorus_row["speedup_vs_gloo_rounds"] == pytest.approx([3.0, 2.5, 1.0])
    assert chorus_row["speedup_vs_gloo"] == pytest.approx(2.0)  # of the medians


def test_to_json_has_speedups_and_meta():
    rows = [_row("chorus", 8, 100.0), _row("gloo", 8, 250.0)]
    doc = to_json(rows, {"transport": "tcp", "baselines": ["gloo"]})
    assert doc["transport"] == "tcp" and doc["baselines"] == ["gloo"]
    chorus_row = next(r for r in doc["rows"] if r["library"] == "chorus")
    assert chorus_row["speedup_vs_gloo"] == pytest.approx(2.5) and chorus_row["us"] == pytest.approx(100.0)
    assert speedups(rows, "gloo") == {8: pytest.approx(2.5)}
    json.dumps(doc)


# -- the command, in process with fake ranks (exit codes, arguments, plot) ----------------

def _fake_spawn(wrong_on_rank1: int):
    """A stand-in for chorus.launch.spawn that writes each rank's result file (and rank
    0's progress records)."""
    class Done:
        def join(self, timeout=None):
            return True

    def spawn(fn, args, nprocs, join=True):
        cfg, workdir = args
        assert os.environ["CHORUS_TRANSPORT"] == cfg["transport"]
        for rank in range(nprocs):
            rows = [Row("chorus", cfg["collective"], c * 4, c, cfg["dtype"], "sum", 1e-4 * (i + 1),
                        wrong_on_rank1 if rank == 1 else 0, nprocs).__dict__
                    for i, c in enumerate(cfg["counts"])]
            with open(os.path.join(workdir, f"rows-{rank}.json"), "w") as f:
                json.dump({"rows": rows, "notes": []}, f)
        for index, row in enumerate(rows, start=1):
            progress.record(workdir, "chorus", index, {"chorus": row["seconds"]})
        return None if join else Done()
    return spawn


def test_wrong_elements_on_any_rank_fail_the_run(monkeypatch, capsys):
    monkeypatch.setattr("chorus.launch.spawn", _fake_spawn(wrong_on_rank1=5))
    assert bench_cli.main(["--world", "2", "-b", "8", "-e", "16", "--baseline", "none",
                           "--transport", "tcp"]) == 1
    out, err = capsys.readouterr()
    assert "transport tcp" in out.splitlines()[0]
    assert [r[-1] for r in _table_rows(out)] == ["5", "5"]
    assert [ln.split(";")[0] for ln in out.splitlines() if ln.startswith("# [")] == [
        "# [1/2] 8: chorus 100.0 us", "# [2/2] 16: chorus 200.0 us"]  # before the table
    assert out.index("# [2/2]") < out.index("size |")
    assert "FAILED" in err
    monkeypatch.setattr("chorus.launch.spawn", _fake_spawn(wrong_on_rank1=0))
    assert bench_cli.main(["--world", "2", "-b", "8", "-e", "16", "--baseline", "none"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["-b", "1M", "-e", "1K"], "larger than"),
    (["-b", "1X"], "bad size"),
    (["--op", "band"], "not defined for float32"),
    (["--collective", "all_gather", "--world", "4", "-b", "4", "-e", "8"], "per rank"),
    (["--baseline", "mpi", "--mpiexec", "/nonexistent/mpiexec"], "--mpiexec"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    assert bench_cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_explicit_baseline_that_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setattr(mpi_worker, "unavailable", lambda mpiexec: "no MPI here")
    assert bench_cli.choose_baselines("mpi", None)[2] == "--baseline mpi: mpi cannot run: no MPI here"
    assert bench_cli.choose_baselines("all", None)[2]
    run, skipped, error = bench_cli.choose_baselines("auto", None)
    assert "mpi" not in run and skipped["mpi"] == "no MPI here" and error is None
    assert bench_cli.choose_baselines("none", None) == ([], {}, None)


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed (pip install matplotlib)")
def test_plot_writes_png(tmp_path, monkeypatch, capsys):
    from chorus.bench.plot import write_plot

    rows = [_row(lib, n, us) for lib, f in (("chorus", 1.0), ("gloo", 3.0), ("mpi", 0.5))
            for n, us in ((8, 100 * f), (1024, 120 * f), (1 << 20, 900 * f))]
    write_plot(rows, str(tmp_path / "sweep.png"), "test")
    barrier = [_row(lib, 0, us, collective="barrier") for lib, us in (("chorus", 10), ("gloo", 40))]
    write_plot(barrier, str(tmp_path / "barrier.png"), "test")
    monkeypatch.setattr("chorus.launch.spawn", _fake_spawn(wrong_on_rank1=0))
    assert bench_cli.main(["--world", "2", "-b", "8", "-e", "1K", "--baseline", "none",
                           "--plot", str(tmp_path / "cli.png")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"# wrote {tmp_path / 'cli.png'}"
    for name in ("sweep.png", "barrier.png", "cli.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_plot_size_ticks_are_few_and_round():
    from chorus.bench.plot import MAX_SIZE_TICKS, size_ticks

    assert size_ticks([4, 256 << 20]) == [16, 256, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
    assert size_ticks([1 << 20, 8 << 20]) == [1 << 20, 2 << 20, 4 << 20, 8 << 20]
    assert size_ticks([1536]) == [1024, 2048]
    for high in range(1, 40):
        assert 1 <= len(size_ticks([1, 1 << high])) <= MAX_SIZE_TICKS


def test_plot_without_matplotlib_is_an_error(monkeypatch, capsys):
    monkeypatch.setattr("chorus.bench.plot.available", lambda: False)
    assert bench_cli.main(["--plot", "x.png", "--baseline", "none"]) == 2
    assert "matplotlib" in capsys.readouterr().err


# -- real runs -----------------------------------------------------------------------------

def test_tiny_real_run(tmp_path):
    out_json = tmp_path / "bench.json"
    proc = _bench("--world", "2", "-b", "8", "-e", "1K", "-n", "2", "-w", "1", "--baseline", "none",
                  "--transport", "tcp", "--json", str(out_json))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("# chorus bench: all_reduce sum, 2 ranks, dtype float32, transport tcp")
    assert len([ln for ln in proc.stdout.splitlines() if ln.startswith("# [")]) == 8  # progress
    assert proc.stdout.splitlines()[-1] == f"# wrote {out_json}"
    rows = _table_rows(proc.stdout)
    assert [r[0] for r in rows] == ["8", "16", "32", "64", "128", "256", "512", "1K"]
    for cells in rows:
        assert len(cells) == 3  # size | chorus | #wrong
        us, busbw = cells[1].split()
        assert float(us) > 0 and cells[2] == "0"
    doc = json.loads(out_json.read_text())
    assert doc["transport"] == "tcp" and doc["baselines"] == [] and doc["baseline"] == "none"
    assert doc["world"] == 2 and doc["collective"] == "all_reduce" and doc["iters"] == 2
    assert doc["sizes"] == [8 << i for i in range(8)]
    assert [r["nbytes"] for r in doc["rows"]] == doc["sizes"]
    assert all(r["library"] == "chorus" and r["wrong"] == 0 and r["seconds"] > 0 for r in doc["rows"])


def test_rounds_real_run(tmp_path):
    """--rounds 3: the sweep three times over; one table row per size (the medians), and
    every round in the JSON."""
    out_json = tmp_path / "bench.json"
    proc = _bench("--world", "2", "-b", "8", "-e", "64", "-f", "8", "-n", "2", "-w", "1", "--baseline", "none",
                  "--transport", "tcp", "--rounds", "3", "--json", str(out_json))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "per size, 3 rounds" in _comments(proc.stdout)
    assert len([ln for ln in proc.stdout.splitlines() if ln.startswith("# [")]) == 6  # progress: 2 sizes x 3
    assert [r[0] for r in _table_rows(proc.stdout)] == ["8", "64"]
    doc = json.loads(out_json.read_text())
    assert doc["rounds"] == 3 and doc["sizes"] == [8, 64]
    assert [(r["nbytes"], len(r["rounds_us"])) for r in doc["rows"]] == [(8, 3), (64, 3)]
    for r in doc["rows"]:
        assert r["us"] == pytest.approx(sorted(r["rounds_us"])[1]) and r["wrong"] == 0


def test_rounds_real_run_against_gloo(tmp_path):
    """--rounds 2 with a baseline: the medians' table, then the per-round speed-up ranges."""
    pytest.importorskip("torch")
    out_json = tmp_path / "bench.json"
    proc = _bench("--world", "2", "-b", "64", "-e", "64", "-n", "2", "-w", "1", "--baseline", "gloo",
                  "--transport", "tcp", "--rounds", "2", "--json", str(out_json))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    at = next(i for i, ln in enumerate(lines) if "vs gloo, each round" in ln)
    cells = lines[at + 2].split()
    assert cells[:2] == ["64", "|"] and cells[2].endswith("x") and cells[3] == "(2)", proc.stdout
    chorus_row = next(r for r in json.loads(out_json.read_text())["rows"] if r["library"] == "chorus")
    assert len(chorus_row["speedup_vs_gloo_rounds"]) == 2 and len(chorus_row["rounds_us"]) == 2


@pytest.mark.parametrize("collective", ["all_reduce", "all_to_all"])
def test_registered_buffers_real_run(tmp_path, collective):
    """--registered: chorus's buffers from chorus.empty_shared, large enough for the mapped
    path (all_reduce from 1 MiB, all_to_all from 4 MiB), every op checked."""
    out_json = tmp_path / "bench.json"
    proc = _bench("--world", "2", "--collective", collective, "-b", "2M", "-e", "4M", "-n", "3", "-w", "1",
                  "--baseline", "none", "--transport", "shm", "--registered", "--json", str(out_json))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "chorus on registered buffers (chorus.empty_shared)" in _comments(proc.stdout)
    doc = json.loads(out_json.read_text())
    assert doc["registered"] is True and [r["nbytes"] for r in doc["rows"]] == [2 << 20, 4 << 20]
    assert all(r["wrong"] == 0 for r in doc["rows"])


@pytest.mark.skipif(NO_MPI is not None, reason=f"MPI baseline unavailable: {NO_MPI}")
def test_mpi_baseline_real_run(tmp_path):
    out_json = tmp_path / "bench.json"
    proc = _bench("--world", "2", "-b", "8", "-e", "1K", "-f", "4", "-n", "2", "-w", "1",
                  "--baseline", "mpi", "--transport", "tcp", "--json", str(out_json))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "baselines: mpi" in _comments(proc.stdout)
    assert len([ln for ln in proc.stdout.splitlines() if ln.startswith("# [")]) == 4  # progress, with mpi
    rows = _table_rows(proc.stdout)
    assert len(rows) == 4
    for cells in rows:
        assert len(cells) == 5  # size | chorus | mpi | vs mpi | #wrong
        assert float(cells[2].split()[0]) > 0 and cells[3].endswith("x") and cells[4] == "0"
    doc = json.loads(out_json.read_text())
    assert doc["baselines"] == ["mpi"] and doc["baseline_info"]["mpi"]["library"]
    assert sorted({r["library"] for r in doc["rows"]}) == ["chorus", "mpi"]
    assert all("speedup_vs_mpi" in r for r in doc["rows"] if r["library"] == "chorus")


@pytest.mark.skipif(NO_MPI is not None, reason=f"MPI baseline unavailable: {NO_MPI}")
def test_mpi_worker_every_collective_is_checked(tmp_path):
    """Every collective through mpi4py in one mpiexec job each, results checked (#wrong 0)."""
    for collective in COLLECTIVES:
        workdir = tmp_path / collective
        workdir.mkdir()
        sizes = [0] if collective == "barrier" else [2, 64]
        cfg = {"world": 2, "counts": sizes, "iters": 2, "warmup": 1, "collective": collective,
               "dtype": "float32", "op": "sum", "transport": "tcp", "baselines": []}
        per_rank, notes, info = mpi_worker.launch(cfg, str(workdir), MPIEXEC, timeout=60)
        assert notes == [], notes
        rows = merge_ranks(per_rank)
        assert [r.count for r in rows] == sizes
        assert all(r.library == "mpi" and r.wrong == 0 and r.seconds > 0 for r in rows), collective


def test_turns_hand_out_one_job_at_a_time(tmp_path):
    import threading

    from chorus.bench import turns

    log: list[str] = []

    def rank(job: str, r: int) -> None:
        t = turns.Turns(str(tmp_path), job, r, os.getpid())
        for index in range(3):
            t.wait(index)
            log.append(f"{job}{index}")
            t.done(index)

    threads = [threading.Thread(target=rank, args=(job, r), daemon=True) for job in ("a", "b") for r in range(2)]
    for th in threads:
        th.start()
    for index in range(3):
        for job in ("a", "b"):
            turns.give_turn(str(tmp_path), job, index, 2)
            assert turns.wait_done(str(tmp_path), job, index, 2, lambda: True)
    for th in threads:
        th.join(5)
    assert not any(th.is_alive() for th in threads)
    assert log == [f"{job}{i}" for i in range(3) for job in ("a", "b") for _ in range(2)]
    assert turns.wait_done(str(tmp_path), "c", 0, 1, lambda: False) is False  # job gone
    turns.Turns(None, "x", 0).wait(7)  # no other job: never waits
    turns.forget(str(tmp_path))
    assert not [k for k in turns._parent_fds if k[0] == str(tmp_path)]


def test_failing_mpi_job_is_reported(tmp_path, monkeypatch, capsys):
    """A broken MPI launcher: the chorus rows still come; --baseline mpi exits 1."""
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'fake mpiexec: boom'\nexit 7\n")
    fake.chmod(0o755)
    monkeypatch.setattr(mpi_worker, "unavailable", lambda mpiexec: None)
    assert bench_cli.main(["--world", "2", "-b", "8", "-e", "16", "-n", "1", "-w", "0",
                           "--baseline", "mpi", "--mpiexec", str(fake)]) == 1
    out = capsys.readouterr().out
    notes = _comments(out)
    assert "mpi failed:" in notes and "boom" in notes and "exited with 7" in notes
    assert [len(r) for r in _table_rows(out)] == [3, 3]  # chorus only


def test_mpi_args_reach_mpiexec_before_the_rank_count(tmp_path, monkeypatch, capsys):
    """--mpi-args: split as a shell would, placed before -n, and named in the notes."""
    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/argv\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(mpi_worker, "unavailable", lambda mpiexec: None)
    assert bench_cli.main(["--world", "2", "-b", "8", "-e", "8", "-n", "1", "-w", "0", "--baseline", "mpi",
                           "--mpiexec", str(fake), "--mpi-args", "--mca btl 'tcp,self'"]) == 1
    argv = (tmp_path / "argv").read_text().split("\n")
    assert argv[:5] == ["--mca", "btl", "tcp,self", "-n", "2"]
    assert "--mca btl tcp,self -n 2" in _comments(capsys.readouterr().out).replace("\n#   ", " ")


def test_batches_give_every_op_its_own_buffers_and_check_each_one():
    from chorus.bench.ops import BATCH_BYTES, batch_size, make_batch, time_case

    assert batch_size("all_reduce", 1, "float32", 4, 500) == 500
    assert batch_size("all_reduce", BATCH_BYTES, "float32", 4, 500) == 1
    batch = make_batch("all_reduce", 8, "float32", 0, 1, "sum", 3)
    assert len({id(b.inp) for b in batch}) == 3 and all(b.expect is batch[0].expect for b in batch)
    ran = []

    def step_for(b):
        def step():
            ran.append(id(b.inp))
            if len(ran) == 7:  # the 7th timed op (2nd of the 3rd batch) goes wrong
                b.inp[0] += 1
        return step

    cases = [(b.reset, step_for(b), b.check) for b in batch]
    barriers = []
    seconds, wrong = time_case(lambda: barriers.append(len(ran)), cases, 8, 0)
    assert wrong == 1 and len(ran) == 8 and seconds >= 0
    assert ran[:3] == ran[3:6] == [id(b.inp) for b in batch]
    assert barriers == [0, 0, 3, 6, 8]  # after warm-up, before each batch, at the end


def test_scaled_iterations_above_one_mib():
    from chorus.bench.ops import iterations

    cfg = {"iters": 200, "warmup": 20, "scale_iters": True}
    assert iterations(cfg, "all_reduce", 1 << 18, "float32", 4) == (200, 20)  # 1 MiB
    assert iterations(cfg, "all_reduce", 1 << 22, "float32", 4) == (12, 1)  # 16 MiB
    assert iterations(cfg, "all_gather", 1 << 26, "float32", 4) == (5, 1)  # 256 MiB output
    assert iterations({**cfg, "scale_iters": False}, "all_reduce", 1 << 26, "float32", 4) == (200, 20)
