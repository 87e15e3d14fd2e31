"""The MPI baseline of ``chorus bench``: ``mpiexec -n W python -m chorus.bench.mpi_worker CFG``.

Each MPI rank times the same cases as ``chorus.bench.worker`` (the buffers, inputs and
expected results of ``chorus.bench.ops``; the same sizes, iterations, warm-up and
:func:`~chorus.bench.ops.time_case`), with mpi4py's buffer calls on numpy arrays
(Allreduce, Bcast, Reduce, Allgather, Reduce_scatter_block, Alltoall, Barrier, Sendrecv),
and writes ``<workdir>/rows-mpi-<rank>.json``.

The job takes turns with the chorus job size by size (``chorus.bench.turns``) when run
by ``chorus bench``.  The parent side (:func:`find_mpiexec`, :func:`unavailable`,
:func:`start`, :func:`collect`, :func:`stop`, :func:`launch`) never imports
mpi4py: importing ``mpi4py.MPI`` initialises MPI in the importing process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from chorus.bench import progress
from chorus.bench.ops import WARMUP_OPS, batch_size, iterations, make_batch, op_label, time_case
from chorus.bench.report import Row
from chorus.bench.turns import Turns

_LAUNCHERS = ("mpiexec", "mpirun")


class MPIRunError(RuntimeError):
    """The mpiexec job failed; the message ends with the tail of its output."""


def find_mpiexec(explicit: str | None = None) -> str | None:
    """The MPI launcher to use: ``explicit`` if given, else ``mpiexec`` (or ``mpirun``)
    next to the running Python (where ``pip install mpich`` puts it: the one that
    matches the MPI library mpi4py loads), in the user's scripts folder, then on PATH."""
    if explicit:
        found = shutil.which(explicit)
        return os.path.abspath(found) if found else None
    folders = [os.path.dirname(sys.executable), sysconfig.get_path("scripts")]
    try:
        folders.append(sysconfig.get_path("scripts", f"{os.name}_user"))
    except KeyError:
        pass
    for folder in folders:
        for name in _LAUNCHERS:
            path = os.path.join(folder, name)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
    for name in _LAUNCHERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def unavailable(mpiexec: str | None) -> str | None:
    """Why the MPI baseline cannot run here (None: it can)."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpi4py mpich, or the 'mpi' extra)"
    if mpiexec is None:
        return "no mpiexec next to this Python or on PATH (pip install mpich, or --mpiexec PATH)"
    return None


def _package_root() -> str:
    """The folder holding the ``chorus`` package (put on the ranks' PYTHONPATH)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(cfg: dict, workdir: str, mpiexec: str) -> subprocess.Popen:
    """Start the MPI job for ``cfg`` (as for worker.rank_main; ``cfg["mpi_args"]``: options
    for ``mpiexec``, before ``-n``, e.g. ``--mca btl tcp,self``); its output goes to
    ``<workdir>/mpi-output.txt``.  :func:`collect` reads its results once it has exited."""
    cfg = {**cfg, "workdir": workdir}
    cfg_path = os.path.join(workdir, "mpi-cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ)
    root = _package_root()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # Open MPI's launcher refuses root and more ranks than cores unless told; MPICH
    # ignores these.
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    cmd = [mpiexec, *shlex.split(cfg.get("mpi_args") or ""), "-n", str(cfg["world"]), sys.executable,
           "-m", "chorus.bench.mpi_worker", cfg_path]
    with open(os.path.join(workdir, "mpi-output.txt"), "w") as out:
        try:
            return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            raise MPIRunError(f"cannot start {mpiexec}: {exc}") from None


def stop(proc: subprocess.Popen) -> None:
    """End the MPI job (mpiexec and its ranks: its own process group) if still running."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def collect(proc: subprocess.Popen, workdir: str, world: int,
            ) -> tuple[dict[int, list[Row]], list[str], dict[str, str]]:
    """The exited MPI job's rows per rank, its notes and what it found out about the MPI
    library; MPIRunError (with the tail of its output) if it failed."""
    with open(os.path.join(workdir, "mpi-output.txt")) as f:
        output = f.read()
    errors = sorted(name for name in os.listdir(workdir) if name.startswith("mpi-error-"))
    if errors:
        with open(os.path.join(workdir, errors[0])) as f:
            raise MPIRunError(f.read().strip())
    per_rank: dict[int, list[Row]] = {}
    notes: list[str] = []
    info: dict[str, str] = {}
    for rank in range(world):
        path = os.path.join(workdir, f"rows-mpi-{rank}.json")
        if proc.returncode != 0 or not os.path.exists(path):
            tail = "\n".join(output.strip().splitlines()[-15:])
            raise MPIRunError(f"{' '.join(map(str, proc.args))} exited with {proc.returncode}"
                              f"{'' if os.path.exists(path) else f' and MPI rank {rank} wrote no result'}"
                              f"; its output ends:\n{tail}")
        with open(path) as f:
            data = json.load(f)
        per_rank[rank] = [Row(**r) for r in data["rows"]]
        if rank == 0:
            notes, info = data["notes"], data["info"]
    return per_rank, notes, info


def launch(cfg: dict, workdir: str, mpiexec: str, timeout: float | None = None,
           ) -> tuple[dict[int, list[Row]], list[str], dict[str, str]]:
    """Run the MPI job alone (no turns) and return what :func:`collect` returns."""
    proc = start({**cfg, "turns": False}, workdir, mpiexec)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise MPIRunError(f"{' '.join(map(str, proc.args))} ran past {timeout} s") from None
    return collect(proc, workdir, cfg["world"])


def _step(comm: Any, MPI: Any, collective: str, inp: np.ndarray, out: np.ndarray, mop: Any,
          rank: int, world: int) -> Callable[[], Any]:
    """One collective with mpi4py's buffer API (upper-case methods, no pickling)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if collective == "all_reduce":
        return lambda: comm.Allreduce(MPI.IN_PLACE, inp, op=mop)
    if collective == "broadcast":
        return lambda: comm.Bcast(inp, root=0)
    if collective == "reduce":
        if rank == 0:
            return lambda: comm.Reduce(MPI.IN_PLACE, inp, op=mop, root=0)
        return lambda: comm.Reduce(inp, None, op=mop, root=0)
    if collective == "all_gather":
        return lambda: comm.Allgather(inp, out)
    if collective == "reduce_scatter":
        return lambda: comm.Reduce_scatter_block(inp, out, op=mop)
    if collective == "all_to_all":
        return lambda: comm.Alltoall(inp, out)
    if collective == "sendrecv":
        return lambda: comm.Sendrecv(inp, dest=nxt, recvbuf=out, source=prv)
    if collective == "barrier":
        return comm.Barrier
    raise ValueError(f"unknown collective {collective!r}")


def _mpi_op(MPI: Any, op: str) -> Any:
    """The MPI reduction for ``op`` (None: MPI has none, e.g. avg)."""
    return {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX, "band": MPI.BAND,
            "bor": MPI.BOR, "bxor": MPI.BXOR}.get(op)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        cfg = json.load(f)
    workdir = cfg["workdir"]
    import mpi4py
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if world != cfg["world"]:
        with open(os.path.join(workdir, f"mpi-error-{os.getpid()}.txt"), "w") as f:
            f.write(f"mpiexec started {world}-rank MPI jobs instead of one with {cfg['world']} ranks: "
                    "the mpiexec used does not belong to the MPI library mpi4py loaded "
                    f"({MPI.Get_library_version().strip().splitlines()[0]}); pass the matching one "
                    "with --mpiexec")
        return 3
    collective, dtype, op = cfg["collective"], cfg["dtype"], cfg["op"]
    itemsize = np.dtype(dtype).itemsize
    first_line = MPI.Get_library_version().strip().splitlines()[0]  # "MPICH Version:  5.0.2"
    info = {"library": " ".join(first_line.replace("Version:", "").split()),
            "mpi4py": mpi4py.__version__}
    rows: list[Row] = []
    notes: list[str] = []
    mop = _mpi_op(MPI, op)
    runnable = True
    if collective in ("all_reduce", "reduce", "reduce_scatter") and mop is None:
        notes.append(f"mpi cannot run {collective} with op {op}: MPI has no such reduction")
        runnable = False
    turns = Turns(workdir if cfg.get("turns") else None, "mpi", rank, cfg.get("parent_pid"))
    for index, count in enumerate([256, *cfg["counts"]]):  # index 0: the warm-up
        turns.wait(index)
        timed: dict[str, float] = {}
        if runnable:
            try:
                iters, warmup = iterations(cfg, collective, count, dtype, world)
                copies = 1 if index == 0 else batch_size(collective, count, dtype, world, iters)
                cases = [(b.reset, _step(comm, MPI, collective, b.inp, b.out, mop, rank, world), b.check)
                         for b in make_batch(collective, count, dtype, rank, world, op, copies)]
                if index == 0:  # before the first timed size, as worker.py does
                    reset, step, _ = cases[0]
                    for _ in range(WARMUP_OPS):
                        reset()
                        step()
                else:
                    seconds, wrong = time_case(comm.Barrier, cases, iters, warmup)
                    rows.append(Row("mpi", collective, count * itemsize, count, dtype,
                                    op_label(collective, op), seconds, wrong, world))
                    timed["mpi"] = seconds
            except (KeyError, ValueError, TypeError, NotImplementedError, MPI.Exception) as exc:
                # e.g. a dtype mpi4py cannot map to an MPI datatype (raised on every rank alike)
                first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                notes.append(f"mpi cannot run {collective} ({dtype}, op {op}): {first_line}")
                runnable = False
        if rank == 0 and index:  # every size, timed or not: the parent's progress waits for it
            progress.record(workdir, "mpi", index, timed)
        turns.done(index)
    with open(os.path.join(workdir, f"rows-mpi-{rank}.json"), "w") as f:
        json.dump({"rows": [asdict(r) for r in rows], "notes": notes, "info": info}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
