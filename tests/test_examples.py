"""The README's demo runs under the launcher and prints what it promises."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_runs_on_4_ranks():
    out = subprocess.run([sys.executable, "-m", "chorus.run", "--nproc-per-node", "4", "--master-port", "0",
                          str(ROOT / "examples" / "quickstart.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "[rank0]:token came back to rank 0 holding 6 (= 0 + 1 + ... + 3)" in lines
    for rank in range(4):
        assert f"[rank{rank}]:rank {rank} of 4 is up" in lines
        left, right = (rank - 1) % 4, (rank + 1) % 4
        assert f"[rank{rank}]:rank {rank}: left neighbour sent {left}, right neighbour sent {right}" in lines
        assert (f"[rank{rank}]:rank {rank}: sum of ranks = 6, gathered [0, 1, 2, 3], "
                "rank 0's config = [0.1, 32.0]") in lines
    assert "[rank0]:averaged gradient = 2.5 (local work meanwhile gave 499500)" in lines
    assert "[rank0]:all ranks passed the barrier" in lines
