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
