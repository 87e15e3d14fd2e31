"""What the process tests share: is a pid still running, waiting for a condition, a free
port for rank 0's store that nothing else can take meanwhile, ranks started by hand, the
checks of a crash test (the survivors' PeerLostError, the job's /dev/shm files), jobs
whose ranks are forks of a server that imported torch once (run_forked), and the
"REPORT {json}" lines that launched scripts print (reports)."""

from __future__ import annotations

import contextlib
import glob
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import secrets
import socket
import subprocess
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reports(text: str) -> list[dict]:
    """The JSON object after each "REPORT " in ``text`` (ranks' output on one pipe): read
    up to where the object ends, so that another process's output written right behind it
    on the same line does not spoil it."""
    decoder = json.JSONDecoder()
    found = []
    for line in text.splitlines():
        at = line.find("REPORT ")
        if at >= 0:
            found.append(decoder.raw_decode(line, at + len("REPORT "))[0])
    return found


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


_HELD: list[socket.socket] = []


def held_port() -> int:
    """A port of 127.0.0.1 reserved as ``reserved_port`` does, held until this test process
    ends: for a test that listens on it later, or needs it refused (nothing listening),
    without a block around the whole test."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return s.getsockname()[1]


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


# -- jobs whose ranks import torch ---------------------------------------------------------------
#: What the forkserver of the torch jobs imports once; every rank of those jobs is a fork of it
#: (``import torch`` costs ~3 s of CPU: a 4-rank job started fresh spends 12 s before its first op).
TORCH_PRELOAD = ["numpy", "torch", "torch.distributed", "torch.multiprocessing", "torch.nn.functional",
                 "torch.nn.parallel", "torch.optim", "torch._dynamo", "torch.distributed.checkpoint",
                 "chorus", "chorus.api.collectives", "chorus.api.exchange", "chorus.api.gathering",
                 "chorus.api.objects", "chorus.api.p2p", "chorus.launch", "chorus.rendezvous", "chorus.store",
                 "chorus.transport.tcp", "chorus.utils", "chorus.torch", "torch_training", "differential_cases",
                 "test_seeds"]
_PASSED_ON = ("CHORUS_", "MASTER_", "PYTHONPATH")


def torch_forkserver():
    """multiprocessing's forkserver context, its server preloaded with torch and chorus.

    Its children are forks of the server: they see the server's environment (the test
    process's when the server started, without CHORUS_* variables), not the caller's --
    pass what they need, as run_forked does."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(TORCH_PRELOAD)
    settings = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("CHORUS_")}
    try:  # the server starts (once) without the settings of the test that happens to start it
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.update(settings)
    return ctx


def _forked_rank(fn, rank, world, args, env, outdir):
    for name in [k for k in os.environ if k.startswith(_PASSED_ON)]:
        del os.environ[name]
    os.environ.update(env)
    try:
        result = fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - the test reports it
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_forked(fn, world: int, *args, env: dict | None = None, timeout: float = 100.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` ranks forked from the torch forkserver, with
    this process's CHORUS_* variables (plus ``env``) and a job token and id of their own;
    returns the results.  A rank that raises or dies stops the others and fails the test
    with its traceback; so does a job still running after ``timeout`` seconds, and one
    that leaves shared-memory files behind."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ON)} | dict(env or {})
    job = "test" + secrets.token_hex(6)
    env.update(CHORUS_TOKEN=secrets.token_hex(16), CHORUS_JOB_ID=job)
    ctx = torch_forkserver()
    with tempfile.TemporaryDirectory(prefix="chorus-forked-") as outdir:
        procs = [ctx.Process(target=_forked_rank, args=(fn, r, world, args, env, outdir)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + timeout
            pending = {p.sentinel: p for p in procs}
            while pending and time.monotonic() < deadline:
                ready = multiprocessing.connection.wait(list(pending), max(0.0, deadline - time.monotonic()))
                exited = [pending.pop(sentinel) for sentinel in ready]
                for p in exited:
                    p.join()
                if any(p.exitcode != 0 for p in exited):
                    break  # the others are killed below
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (0, None)]
            stuck = [r for r, p in enumerate(procs) if p.exitcode is None]
        finally:
            for p in procs:
                p.kill()
                p.join()
        if failed or stuck:
            errors = {r: _read(os.path.join(outdir, f"rank{r}.err")) or f"exit code {procs[r].exitcode}"
                      for r in failed}
            raise AssertionError(f"ranks {failed} failed, ranks {stuck} were still running "
                                 f"(timeout {timeout} s):\n" + "\n".join(f"rank {r}: {e}" for r, e in errors.items()))
        results = []
        for r in range(world):
            with open(os.path.join(outdir, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    assert not leftovers(job), f"the job's ranks exited and left {leftovers(job)}"
    return results


def _read(path: str) -> str:
    return open(path).read() if os.path.exists(path) else ""
