"""torch's own distributed test suite on chorus: a few of its tests, on every run.

The whole suite is a command, ``tools/torch_suite.py`` (docs/torch-suite.md; its times in
docs/results/2-vcpu-epyc/torch-suite/); this runs the tests that cover what chorus had to
match gloo in: profiler events, sparse all_reduce, timeout and monitored_barrier wording,
DDP with a communication hook, with every gloo group made a chorus group.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MISSING = [m for m in ("torch", "expecttest") if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.skipif(bool(MISSING), reason=f"torch's test suite needs {' and '.join(MISSING)} "
                                              "(pip install -e '.[test]')"),
    pytest.mark.slow,
]

SUBSET = [
    "test_all_reduce_sum",                           # results and "gloo:all_reduce" profiler events
    "test_sparse_all_reduce_sum",
    # (the wording of timeouts and of monitored_barrier: tests/test_p2p_threads.py,
    # tests/test_groups.py; torch's tests of it wait for their timeouts)
    "test_accumulate_gradients_no_sync_allreduce_hook",  # DDP, get_future()
]


def test_a_subset_of_torchs_suite_passes_with_chorus_in_place_of_gloo(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(ROOT / "tools" / "torch_suite.py"), "--backend", "chorus-for-gloo",
           "--json", str(out), "--log", str(tmp_path / "ranks.log")]
    for name in SUBSET:
        cmd += ["--test", name]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    assert out.exists(), proc.stdout + proc.stderr
    tests = json.loads(out.read_text())["tests"]
    outcomes = {name: tests[name]["outcome"] for name in SUBSET}
    assert outcomes == dict.fromkeys(SUBSET, "passed"), (
        f"{outcomes}\n{proc.stdout}\n" + (tmp_path / "ranks.log").read_text()[-6000:])
