"""Two threads of every rank calling all_reduce on one group at once, ``--runs`` jobs:
each call is either refused (ConcurrentCallError, and called again) or returns a whole
sum of one call per rank; a mixture, a stale buffer or a hang counts as wrong."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import tempfile
import time

from faults.common import job_env, reserved_port, shm_files, start_rank


def add_arguments(p) -> None:
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--ops", type=int, default=200, help="all_reduces per thread")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--counts", default="1000,262144",
                   help="float32 elements per all_reduce, one per run in turn (the latency lane, the general path)")
    p.add_argument("--transports", default="auto,tcp", help="CHORUS_TRANSPORT, one per run in turn")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take")


def run(args) -> dict:
    counts = [int(c) for c in args.counts.split(",")]
    transports = args.transports.split(",")
    runs = []
    for i in range(args.runs):
        count, transport = counts[i % len(counts)], transports[(i // len(counts)) % len(transports)]
        job = "threads" + secrets.token_hex(4)
        with tempfile.TemporaryDirectory(prefix="chorus-threads-") as out:
            env = job_env(job, CHORUS_TRANSPORT=transport)
            began = time.monotonic()
            with reserved_port() as port:
                procs = [start_rank("threads_rank.py", [out, str(args.ops), str(count)], env, r, args.world, port,
                                    stderr=subprocess.PIPE, text=True)
                         for r in range(args.world)]
            hung = False
            for p in procs:
                try:
                    p.wait(max(1.0, began + args.timeout - time.monotonic()))
                except subprocess.TimeoutExpired:
                    hung = True
                    p.kill()
                    p.wait()
            ranks = []
            for r, p in enumerate(procs):
                path = os.path.join(out, f"rank{r}.json")
                ranks.append(json.load(open(path)) if os.path.exists(path)
                             else {"rank": r, "exit_code": p.returncode, "stderr": p.stderr.read()[-2000:]})
        runs.append({"count": count, "transport": transport, "hung": hung, "seconds": round(time.monotonic() - began, 1),
                     "returned": sum(r.get("returned", 0) for r in ranks), "wrong": sum(r.get("wrong", 0) for r in ranks),
                     "refused": sum(r.get("refused", 0) for r in ranks),
                     "errors": [e for r in ranks for e in r.get("errors", [])][:5],
                     "incomplete_ranks": [r for r in ranks if "returned" not in r]})
    wrong = sum(r["wrong"] for r in runs)
    expected = args.runs * args.world * 2 * args.ops
    returned = sum(r["returned"] for r in runs)
    summary = {"runs": args.runs, "wrong_results": wrong, "results_returned": returned, "results_expected": expected,
               "refused_calls": sum(r["refused"] for r in runs), "runs_hung": sum(r["hung"] for r in runs),
               "runs_with_errors": sum(bool(r["errors"] or r["incomplete_ranks"]) for r in runs),
               "chorus_files_in_dev_shm_after": len(shm_files()),
               "met": wrong == 0 and returned == expected}
    return {"summary": summary, "runs": runs}
