"""A network partition during 64 MiB all_reduces: two ranks in two network namespaces
joined by a veth pair; once both have finished one all_reduce, the link is cut at a
seeded random moment (``down``: both ends of the link set down; ``blackhole``: each side
routes the other's address into a blackhole, the link staying up) — no RST, no EOF.  Every rank must raise within its op deadline plus
the heartbeat timeout.  Needs root and iproute2; only namespaces and addresses made here
are touched, and removed.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import subprocess
import sys
import tempfile
import time

from faults.common import JOBS, job_env, wait_for


def add_arguments(p) -> None:
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--timeout", type=float, default=30.0, help="the ranks' op timeout (seconds)")
    p.add_argument("--heartbeat", type=float, default=20.0, help="CHORUS_HEARTBEAT_TIMEOUT (seconds)")
    p.add_argument("--cut", default="down,blackhole", help="how the link is cut, one per run in turn")
    p.add_argument("--seed", type=int, default=1)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _namespaces(tag: str) -> tuple[str, str]:
    a, b = f"chorus{tag}a", f"chorus{tag}b"
    _ip("netns", "add", a)
    _ip("netns", "add", b)
    _ip("-n", a, "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", b)
    for ns, dev, addr in ((a, "va", "10.231.0.1/30"), (b, "vb", "10.231.0.2/30")):
        _ip("-n", ns, "addr", "add", addr, "dev", dev)
        _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
    return a, b


def _cut(namespaces: tuple[str, str], how: str) -> None:
    for ns, dev, other in zip(namespaces, ("va", "vb"), ("10.231.0.2", "10.231.0.1"), strict=True):
        if how == "down":
            _ip("-n", ns, "link", "set", dev, "down")
        else:
            _ip("-n", ns, "route", "add", "blackhole", f"{other}/32")


def _one(args, how: str, delay: float) -> dict:
    tag = secrets.token_hex(3)
    namespaces = _namespaces(tag)
    try:
        with tempfile.TemporaryDirectory(prefix="chorus-partition-") as out:
            env = job_env("partition" + tag, MASTER_ADDR="10.231.0.1", MASTER_PORT="29511", WORLD_SIZE="2",
                          CHORUS_HEARTBEAT_TIMEOUT=str(args.heartbeat), CHORUS_TRANSPORT="tcp",
                          CHORUS_TOKEN=secrets.token_hex(16))
            env.pop("CHORUS_SOCKET_HOST", None)
            procs = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, os.path.join(JOBS, "partition_rank.py"),
                                       out, str(args.timeout)], env=dict(env, RANK=str(r)),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                     for r, ns in enumerate(namespaces)]
            try:
                ready = wait_for(lambda: all(os.path.exists(os.path.join(out, f"ready{r}")) for r in range(2))
                                 or any(p.poll() is not None for p in procs), 120)
                if not ready or any(p.poll() is not None for p in procs):
                    return {"cut": how, "error": "the job did not start", "stderr": [p.stderr.read()[-1000:] for p in procs
                                                                                      if p.poll() is not None]}
                time.sleep(delay)
                cut = time.time()
                _cut(namespaces, how)
                limit = args.timeout + args.heartbeat + 30
                for p in procs:
                    try:
                        p.wait(max(1.0, cut + limit - time.time()))
                    except subprocess.TimeoutExpired:
                        pass
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
            ranks = []
            for r in range(2):
                path = os.path.join(out, f"rank{r}.json")
                if os.path.exists(path):
                    data = json.load(open(path))
                    ranks.append({"raised_after_cut_s": round(data["time"] - cut, 2), "ops": data["ops"],
                                  "error": data["error"][:400]})
                else:
                    ranks.append({"raised_after_cut_s": None, "error": "raised nothing"})
        return {"cut": how, "cut_after_ready_s": round(delay, 2), "ranks": ranks}
    finally:
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run(args) -> dict:
    if os.geteuid() != 0:
        return {"summary": {"met": False, "skipped": "needs root to make network namespaces"}}
    rng = random.Random(args.seed)
    hows = args.cut.split(",")
    runs = [_one(args, hows[i % len(hows)], rng.uniform(0.0, 2.0)) for i in range(args.runs)]
    limit = args.timeout + args.heartbeat
    times = [r["raised_after_cut_s"] for run in runs for r in run.get("ranks", [])]
    latest = max((t for t in times if t is not None), default=None)
    summary = {"runs": len(runs), "op_timeout_s": args.timeout, "heartbeat_timeout_s": args.heartbeat,
               "limit_s": limit, "latest_raise_after_cut_s": latest,
               "ranks_that_raised_nothing": sum(t is None for t in times),
               "met": bool(times) and None not in times and latest <= limit}
    return {"summary": summary, "runs": runs}
