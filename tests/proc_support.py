"""What the process tests share: is a pid still running, waiting for a condition, a free
port for rank 0's store that nothing else can take meanwhile, ranks started by hand, and
the checks of a crash test (the survivors' PeerLostError, the job's /dev/shm files)."""

from __future__ import annotations

import contextlib
import glob
import os
import socket
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(condition, timeout: float) -> bool:
    """Poll ``condition()`` every 20 ms for up to ``timeout`` seconds; return its last value."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@contextlib.contextmanager
def reserved_port():
    """A free port of 127.0.0.1 that stays bound (SO_REUSEADDR, not listening) until the block
    ends.  Rank 0's store server (chorus's and torch's set SO_REUSEADDR) can still listen on it,
    but no other process's outgoing connection or bind to port 0 gets it meanwhile.  Closing
    the socket before the ranks start, as a plain "free port" does, lets a busy machine hand
    the port to someone else first: rank 0 then fails with EADDRINUSE and the other ranks wait
    for a store that never comes (with torch, until the test's timeout)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def run_ranks(argv: list[str], world: int, env: dict | None = None, timeout: float = 60.0):
    """Run ``argv`` as ``world`` ranks with torchrun's variables (rank 0 hosts the store on a
    reserved port) until all exit; return the Popens and their (stdout, stderr)."""
    env = dict(env or os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))  # chorus under test
    with reserved_port() as port:
        procs = [subprocess.Popen(argv, env=dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                                 RANK=str(r), WORLD_SIZE=str(world)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        try:
            return procs, [p.communicate(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                p.kill()


def leftovers(job: str) -> list[str]:
    """The /dev/shm files of job ``job`` (chorus names them chorus-<job>-...)."""
    return glob.glob(f"/dev/shm/chorus-{job}-*")


def check_survivors(outdir, world: int, victim: int) -> None:
    """Every rank but ``victim`` wrote ``outdir/rank<r>`` ("<time>\\n<PeerLostError message>")
    naming it, within 5 s of the time the victim wrote to ``outdir/killed`` before dying."""
    killed_at = float((outdir / "killed").read_text())
    for rank in set(range(world)) - {victim}:
        when, message = (outdir / f"rank{rank}").read_text().split("\n", 1)
        assert float(when) - killed_at < 5.0 and f"rank {victim}" in message, (rank, message)
