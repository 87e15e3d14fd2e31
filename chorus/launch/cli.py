"""``chorusrun``: a torchrun-compatible launcher for one node of a job.

Usage::

    chorusrun --nproc-per-node 4 train.py --lr 0.1
    chorusrun --standalone --nproc-per-node auto -m my_pkg.train
    chorusrun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --token-file ~/.job-token train.py  # node 0
    chorusrun --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --token-file ~/.job-token train.py  # node 1

Node 0's launcher hosts the rendezvous store (a ``chorus.store.TCPStoreServer``) on
``--master-addr:--master-port`` before starting its ranks, and every rank connects to it
as a client (``CHORUS_STORE_HOSTED=1``, ``CHORUS_STORE_PORT``).  Each rank gets the
torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, ...) plus CHORUS_TOKEN and CHORUS_JOB_ID.
MASTER_PORT is not the store's port: it is left to torch.distributed's own ``env://``
rendezvous, whose rank 0 binds it, so that plain torch scripts (gloo, nccl; no chorus
import) run under chorusrun as under torchrun's static launch.  On one node it is a free
port the launcher keeps reserved for the job; on several it is ``--master-port + 1``
(every node must derive the same one: open both ports on node 0).

Decisions (where torchrun has no exact counterpart):

- ``--standalone`` means one node; combining it with ``--nnodes > 1`` is an error.
- The job token is ``--token-file``'s content (surrounding whitespace stripped), else
  ``--token``, else ``$CHORUS_TOKEN``, else a fresh random one on a single node; several
  nodes without a token run unauthenticated (with a warning).  The ranks get it in their
  environment, never on their command line.  ``--token VALUE`` warns: every local user
  can read the launcher's command line (``/proc/PID/cmdline``, ``ps``).  A token file
  that cannot be read or is empty is an error before any rank starts; one that group or
  other users can read gives a warning.
- The job id is ``--run-id``/``--rdzv-id``, else random on one node; on several nodes
  it is derived from the token and master address so that all nodes agree.
- Output is always shown on the console (prefixed ``[rankN]:``); ``--log-dir`` also
  keeps each rank's raw output in ``rank{N}.log``.
- Like torchrun, ``OMP_NUM_THREADS`` defaults to 1 when several ranks share the node.
- When the job ends, the job's ``/dev/shm`` leftovers are swept; a janitor process
  (``chorus.launch.janitor``) does it when chorusrun is SIGKILLed (its ranks die with it).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import signal
import socket
import sys
import time

from chorus import config
from chorus.launch.supervisor import RankSpec, Supervisor, format_failure, signal_name

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


class UsageError(Exception):
    """Bad command line; the message says what to change."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; both ``--dash-names`` and torchrun's ``--under_scores``."""
    p = argparse.ArgumentParser(
        prog="chorusrun", allow_abbrev=False,
        description="Start the ranks of a chorus (or torch.distributed) job on this node.",
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default="1",
                   help="ranks on this node: an integer, 'auto' or 'cpu' (= CPU count)")
    p.add_argument("--nnodes", default="1", help="number of nodes: N or N:N (default 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                   help="this node's index, 0 .. nnodes-1 (default 0)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr",
                   default=DEFAULT_MASTER_ADDR, help="address of node 0 (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                   default=DEFAULT_MASTER_PORT,
                   help="port of the rendezvous store on node 0; 0 picks a free one "
                        "(default 29500)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default=None,
                   help="HOST[:PORT] of node 0; same as --master-addr/--master-port")
    p.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default=None,
                   choices=["static", "c10d"], help="accepted for torchrun compatibility")
    p.add_argument("--standalone", action="store_true",
                   help="single-node job on a free local port (ignores master addr/port)")
    p.add_argument("--run-id", "--rdzv-id", "--rdzv_id", dest="run_id", default=None,
                   help="job id (CHORUS_JOB_ID, TORCHELASTIC_RUN_ID); random if not given")
    p.add_argument("--token-file", "--token_file", dest="token_file", default=None,
                   help="file holding the job token that authenticates every connection "
                        "(default: $CHORUS_TOKEN, or a random one on a single node); "
                        "make it readable by you only (chmod 600)")
    p.add_argument("--token", default=None,
                   help="the job token itself; other local users can read it in the process "
                        "list, so prefer --token-file or $CHORUS_TOKEN")
    p.add_argument("--log-dir", "--log_dir", dest="log_dir", default=None,
                   help="also write each rank's raw output to LOG_DIR/rank{N}.log")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the script as a module, like 'python -m'")
    p.add_argument("--no-python", "--no_python", dest="no_python", action="store_true",
                   help="run the script as an executable, without 'python'")
    p.add_argument("training_script", help="the script (or module, or executable) to run")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER,
                   help="arguments passed to the script unchanged")
    return p


def parse_nproc(value: str) -> int:
    """``"4" -> 4``; ``"auto"``/``"cpu"`` -> CPU count."""
    if value in ("auto", "cpu"):
        return os.cpu_count() or 1
    if value == "gpu":
        raise UsageError("--nproc-per-node gpu: chorus runs on CPUs; pass an integer or 'auto'")
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"--nproc-per-node {value!r}: expected an integer, 'auto' or 'cpu'") from None
    if n < 1:
        raise UsageError(f"--nproc-per-node {n}: needs at least 1 rank per node")
    return n


def parse_nnodes(value: str) -> int:
    """``"2" -> 2``, ``"2:2" -> 2``; elastic ranges (``"1:4"``) are refused."""
    lo, _, hi = value.partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi or lo)
    except ValueError:
        raise UsageError(f"--nnodes {value!r}: expected N or N:N, e.g. --nnodes 2") from None
    if lo_n != hi_n:
        raise UsageError(f"--nnodes {value}: elastic node ranges are not supported; "
                         f"pass a fixed count such as --nnodes {hi_n}")
    if lo_n < 1:
        raise UsageError(f"--nnodes {value}: needs at least 1 node")
    return lo_n


def read_token_file(path: str, warnings: list[str]) -> str:
    """The token in ``path`` (surrounding whitespace stripped); UsageError naming the file
    if it cannot be read or holds no token; a warning if group or other users can read it."""
    fix = (f"write the job token into it, readable by you only (e.g. python3 -c 'import secrets; "
           f"print(secrets.token_hex(16))' > {path}; chmod 600 {path})")
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UsageError(f"--token-file {path}: cannot read it ({reason}); {fix}") from None
    if not token:
        raise UsageError(f"--token-file {path}: the file is empty; {fix}")
    if mode & 0o044:
        warnings.append(f"the token file {path} can be read by other users (mode {mode & 0o777:03o}); "
                        f"chmod 600 {path}")
    return token


class Job:
    """The resolved settings of one launcher invocation."""

    def __init__(self, args: argparse.Namespace):
        self.nproc = parse_nproc(args.nproc_per_node)
        self.nnodes = parse_nnodes(args.nnodes)
        self.node_rank = args.node_rank
        self.world_size = self.nproc * self.nnodes
        if not 0 <= self.node_rank < self.nnodes:
            raise UsageError(f"--node-rank {self.node_rank}: must be in 0..{self.nnodes - 1} "
                             f"for --nnodes {self.nnodes}")
        self.master_addr, self.master_port = args.master_addr, args.master_port
        if args.rdzv_endpoint:
            host, _, port = args.rdzv_endpoint.rpartition(":")
            if host and port.isdigit():
                self.master_addr, self.master_port = host.strip("[]"), int(port)
            else:
                self.master_addr = args.rdzv_endpoint.strip("[]")
        if args.standalone:
            if self.nnodes != 1:
                raise UsageError(f"--standalone runs a single-node job but --nnodes is "
                                 f"{self.nnodes}; drop --standalone and give every node "
                                 f"--master-addr/--master-port of node 0")
            self.master_addr, self.master_port = DEFAULT_MASTER_ADDR, 0
        if not 0 <= self.master_port < 65536:
            raise UsageError(f"--master-port {self.master_port}: must be in 0..65535")
        if self.master_port == 0 and self.node_rank != 0:
            raise UsageError("--master-port 0 only works on node 0 (which picks the port); "
                             "other nodes need node 0's real port")
        if args.module and args.no_python:
            raise UsageError("-m/--module and --no-python cannot be combined")
        self.warnings: list[str] = []
        if args.token_file is not None and args.token is not None:
            raise UsageError("pass either --token-file or --token, not both")
        if args.token_file is not None:
            self.token = read_token_file(args.token_file, self.warnings)
        else:
            if args.token:
                self.warnings.append(
                    "--token on the command line can be read by every user of this machine "
                    "(/proc/PID/cmdline, ps); pass --token-file PATH (a file only you can read) "
                    "or set CHORUS_TOKEN instead")
            self.token = args.token or config.get("CHORUS_TOKEN") or None
        if self.token is None and self.nnodes == 1:
            self.token = secrets.token_hex(16)
        self.run_id = args.run_id
        self.log_dir = args.log_dir
        if args.no_python:
            self.cmd_prefix = [args.training_script]
        elif args.module:
            self.cmd_prefix = [sys.executable, "-u", "-m", args.training_script]
        else:
            self.cmd_prefix = [sys.executable, "-u", args.training_script]
        self.script_args = list(args.training_script_args)

    def _default_run_id(self, master_port: int) -> str:
        if self.nnodes == 1:
            return secrets.token_hex(8)
        seed = f"{self.token}|{self.master_addr}|{master_port}".encode()
        return hashlib.sha256(seed).hexdigest()[:16]

    def rank_specs(self, master_port: int, torch_port: int) -> list[RankSpec]:
        """One :class:`RankSpec` per local rank, with the full environment.

        ``master_port`` is the store's real port (node 0 may have picked it); ``torch_port``
        the ranks' MASTER_PORT (see the module docstring).
        """
        run_id = self.run_id or self._default_run_id(master_port)
        self.job_id = run_id  # the shared-memory segments of the job are named after it
        base = dict(os.environ)
        if self.nproc > 1 and "OMP_NUM_THREADS" not in base:
            base["OMP_NUM_THREADS"] = "1"
        base.update(
            WORLD_SIZE=str(self.world_size), LOCAL_WORLD_SIZE=str(self.nproc),
            GROUP_RANK=str(self.node_rank), GROUP_WORLD_SIZE=str(self.nnodes),
            ROLE_NAME="default", ROLE_WORLD_SIZE=str(self.world_size),
            MASTER_ADDR=self.master_addr, MASTER_PORT=str(torch_port), CHORUS_STORE_PORT=str(master_port),
            CHORUS_JOB_ID=run_id, TORCHELASTIC_RUN_ID=run_id,
            TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
            CHORUS_STORE_HOSTED="1", PYTHONUNBUFFERED="1",
        )
        if self.token:
            base["CHORUS_TOKEN"] = self.token
        specs = []
        for local in range(self.nproc):
            rank = self.node_rank * self.nproc + local
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(local), ROLE_RANK=str(rank))
            specs.append(RankSpec(rank, local, self.cmd_prefix + self.script_args, env))
        return specs


def host_store(job: Job):
    """Start the rendezvous store server on node 0; raise RuntimeError naming host:port."""
    from chorus.store import TCPStoreServer

    # Bind the master address on one node; on several, listen on every interface so
    # that a hostname resolving to a loopback alias on node 0 still works.
    host = job.master_addr if job.nnodes == 1 else "0.0.0.0"
    try:
        return TCPStoreServer(host, job.master_port, token=job.token)
    except Exception as e:
        msg = f"chorusrun: cannot host the rendezvous store on {host}:{job.master_port}: {e}"
        if "--master-port 0" not in msg:
            msg += (" If another job uses that port, pass --master-port 0 to pick a free "
                    "port (or choose another port).")
        raise RuntimeError(msg) from e


def torch_port(job: Job, store_port: int) -> tuple[int, socket.socket | None]:
    """The ranks' MASTER_PORT (see the module docstring), and on one node the socket that
    reserves it: bound, not listening, with SO_REUSEADDR, so that no other process's bind
    or outgoing connection takes it while the job runs, and the job's rank 0 can still
    listen on it (torch's store server sets SO_REUSEADDR too)."""
    if job.nnodes > 1:
        return store_port + 1, None
    family = socket.AF_INET6 if ":" in job.master_addr else socket.AF_INET
    reserved = socket.socket(family)
    try:
        reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        reserved.bind((job.master_addr, 0))
    except OSError:
        reserved.close()
        raise
    return reserved.getsockname()[1], reserved


def _install_signal_handlers(sup: Supervisor) -> dict:
    def on_signal(signum, _frame):
        sup.request_stop(signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            previous[sig] = signal.signal(sig, on_signal)
    return previous


def main(argv: list[str] | None = None) -> int:
    """Run ``chorusrun`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    args = build_parser().parse_args(argv)
    try:
        job = Job(args)
    except UsageError as e:
        print(f"chorusrun: error: {e}", file=sys.stderr)
        return 2
    for warning in job.warnings:
        print(f"chorusrun: warning: {warning}", file=sys.stderr)
    if job.token is None:
        print(f"chorusrun: warning: no --token-file or $CHORUS_TOKEN for a {job.nnodes}-node job; "
              f"connections are unauthenticated (pass the same --token-file on every node)",
              file=sys.stderr)
    server = None
    port = job.master_port
    if job.node_rank == 0:
        try:
            server = host_store(job)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        port = server.port
    janitor = None
    reserved = None
    started = time.time()
    try:
        master_port, reserved = torch_port(job, port)
        sup = Supervisor(job.rank_specs(port, master_port), log_dir=job.log_dir)
        janitor = _start_janitor(job.job_id)
        previous = _install_signal_handlers(sup)
        try:
            try:
                sup.start()
            except OSError as e:
                print(f"chorusrun: cannot start {job.cmd_prefix[0]!r}: {e}", file=sys.stderr)
                return 1
            janitor.watch(sup.pids())
            outcome = sup.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        if server is not None:
            server.close()
        if reserved is not None:
            reserved.close()
        _sweep_shared_memory(getattr(job, "job_id", None))
        if janitor is not None:
            janitor.dismiss()
    if outcome.first_failure is not None:
        sys.stderr.write(format_failure(outcome.first_failure, job.world_size))
    elif outcome.received_signal is not None:
        print(f"chorusrun: received {signal_name(outcome.received_signal)}; forwarded it to "
              f"the {job.nproc} ranks of this node and stopped them", file=sys.stderr)
    if outcome.exit_code != 0:
        _print_analysis(started)
    sys.stderr.flush()
    return outcome.exit_code


def _print_analysis(since: float) -> None:
    """When the job failed or was stopped and ``CHORUS_FLIGHT_RECORDER_DIR`` is set, print
    what ``chorus analyze`` says of the dumps the ranks wrote there (chorus.debug.analyze)."""
    directory = config.get("CHORUS_FLIGHT_RECORDER_DIR")
    if not directory:
        return
    from chorus.debug.analyze import summary  # imported here: chorusrun --help stays fast

    text = summary(directory, since=since)
    if text:
        sys.stderr.write(f"chorusrun: the flight recorders in {directory} say:\n{text}")
    else:
        print(f"chorusrun: no rank wrote a flight recorder dump into {directory}", file=sys.stderr)


def _start_janitor(job_id: str):
    """The process that sweeps the job's /dev/shm leftovers if chorusrun is SIGKILLed
    (chorus.launch.janitor); imported here: chorusrun --help stays fast."""
    from chorus.launch.janitor import Janitor

    return Janitor(job_id)


def _sweep_shared_memory(job_id: str | None) -> None:
    """Remove /dev/shm segments a killed rank may have left (chorus.shm unlinks its segments
    as soon as every rank has mapped them, so normally there is nothing to remove)."""
    if not job_id:
        return
    from chorus.host.segment import sweep  # imported here: chorusrun --help stays fast

    removed = sweep(job_id)
    if removed:
        print(f"chorusrun: removed {len(removed)} shared-memory segment(s) left by the job",
              file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
