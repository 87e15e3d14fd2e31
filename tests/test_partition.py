"""A network partition in the middle of large all_reduces: two ranks in two
network namespaces joined by a veth pair loop over 64 MiB all_reduces; the link goes
down on both sides (no RST, no EOF: a true partition).  Each rank must raise within its
op deadline plus the heartbeat timeout — before, a rank sat in ``sendall`` for minutes.

Needs root and ``ip netns``; skipped with the reason otherwise.  Only namespaces and
addresses this test creates are touched, and it removes them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

OP_TIMEOUT, HEARTBEAT = 4.0, 2.0

_RANK = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import chorus as dist

    out, rank = sys.argv[1], int(os.environ["RANK"])
    dist.init_process_group("chorus", timeout=float(os.environ["OP_TIMEOUT"]))
    x = np.ones(16 << 20, np.float32)  # 64 MiB
    dist.all_reduce(x)
    open(f"{out}/ready{rank}", "w").close()
    try:
        while True:
            dist.all_reduce(x)
    except Exception as exc:
        with open(f"{out}/rank{rank}", "w") as f:
            f.write(f"{time.time()!r}\\n{type(exc).__name__}: {exc}")
        os._exit(3)
""")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def namespaces():
    """Two fresh namespaces joined by a veth pair: 10.231.0.1 (A) and 10.231.0.2 (B)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns) to make network namespaces")
    a, b = f"chorus{os.getpid()}a", f"chorus{os.getpid()}b"
    made = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("-n", a, "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", b)
        for ns, dev, addr in ((a, "va", "10.231.0.1/30"), (b, "vb", "10.231.0.2/30")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {getattr(exc, 'stderr', b'') or exc}")
    yield a, b
    for ns in made:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_a_partition_during_64_mib_all_reduces_fails_every_rank_within_deadline_plus_heartbeat(
        namespaces, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    env = dict(os.environ, MASTER_ADDR="10.231.0.1", MASTER_PORT="29511", WORLD_SIZE="2",
               OP_TIMEOUT=str(OP_TIMEOUT), CHORUS_HEARTBEAT_TIMEOUT=str(HEARTBEAT),
               CHORUS_TRANSPORT="tcp", CHORUS_TOKEN="partition-test-token")
    env.pop("CHORUS_SOCKET_HOST", None)
    procs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(script), str(tmp_path)],
                              env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for rank, ns in enumerate(namespaces)]
    try:
        start = time.monotonic()
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert time.monotonic() - start < 30 and all(p.poll() is None for p in procs), \
                [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.05)
        for ns, dev in zip(namespaces, ("va", "vb"), strict=True):
            _ip("-n", ns, "link", "set", dev, "down")
        cut = time.time()
        limit = OP_TIMEOUT + HEARTBEAT + 2.0
        for p in procs:
            p.wait(timeout=limit + 5)
    finally:
        for p in procs:
            p.kill()
        errs = [p.communicate()[1] for p in procs]
    for rank in range(2):
        report = tmp_path / f"rank{rank}"
        assert report.exists(), f"rank {rank} raised nothing: {errs[rank][-2000:]}"
        when, message = report.read_text().split("\n", 1)
        assert message.startswith(("PeerLostError", "CommTimeoutError")), message
        assert float(when) - cut < limit, (rank, float(when) - cut, message)
