"""What the fault campaigns share: ranks started by hand (torchrun's variables), a port
that stays reserved until rank 0's store takes it, looks at processes through /proc
(descriptors, threads, listening ports, descendants), the chorus files in /dev/shm, and
the result file with its command line in the header."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import platform
import re
import resource
import shlex
import socket
import subprocess
import sys
import time

TOOLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TOOLS)
JOBS = os.path.join(TOOLS, "faults", "jobs")  # the ranks' scripts


def job_env(job: str, **extra: str) -> dict[str, str]:
    """This process's environment with chorus from this checkout, ``CHORUS_JOB_ID=job``
    (its /dev/shm files carry the name) and ``extra``."""
    env = dict(os.environ, CHORUS_JOB_ID=job, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


@contextlib.contextmanager
def reserved_port():
    """A free port of 127.0.0.1, bound (SO_REUSEADDR, not listening) until the block ends,
    so that no other process takes it before rank 0's store listens on it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def limit_open_files(n: int):
    """A ``preexec_fn`` that sets the child's soft open-file limit to ``n``."""
    def apply() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    return apply


def start_rank(script: str, args: list[str], env: dict, rank: int, world: int, port: int,
               nofile: int | None = None, **popen) -> subprocess.Popen:
    """``python3 jobs/<script> args...`` as rank ``rank`` of ``world``, started by hand."""
    env = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return subprocess.Popen([sys.executable, os.path.join(JOBS, script), *args], env=env,
                            preexec_fn=None if nofile is None else limit_open_files(nofile), **popen)


def shm_files() -> list[str]:
    """chorus's files in /dev/shm now (every job's)."""
    return sorted(os.path.basename(p) for p in glob.glob("/dev/shm/chorus-*"))


_CREATOR = re.compile(r"-\d+\.(\d+)-[0-9a-f]{12}$")  # chorus.host.segment's names end in <ns>.<pid>-<random>


def files_of(pids, names: list[str]) -> list[str]:
    """Those of ``names`` (shm_files) that a process of ``pids`` created."""
    pids = {str(p) for p in pids}
    return [n for n in names if (m := _CREATOR.search(n)) is not None and m.group(1) in pids]


def rank_pids(out: str) -> dict[int, int]:
    """rank -> pid, from the ``pid.<rank>`` files the campaigns' jobs write."""
    found = {}
    for name in os.listdir(out):
        if name.startswith("pid."):
            try:
                found[int(name[4:])] = int(open(os.path.join(out, name)).read())
            except (OSError, ValueError):
                pass
    return found


def descriptors(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return -1


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in glob.glob(f"/proc/{parent}/task/*/children"):
            try:
                kids = [int(k) for k in open(task).read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (its sockets matched in /proc/net/tcp*)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    except OSError:
        return set()
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def wait_for(condition, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def machine() -> str:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    return f"{model or platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python {platform.python_version()}"


def write_result(path: str | None, argv: list[str], result: dict) -> None:
    """The result as JSON, its first keys the command that made it and the machine."""
    data = {"command": "python3 tools/fault_campaign.py " + shlex.join(argv), "machine": machine(),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **result}
    text = _innermost_lists_on_one_line(json.dumps(data, indent=1)) + "\n"
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    sys.stdout.write(text if not path else json.dumps(result.get("summary", {}), indent=1) + "\n")


def _innermost_lists_on_one_line(text: str) -> str:
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
