"""A soak: one job after another for ``--minutes``, each of random size (2 or 3 ranks),
launcher (by hand, chorus.spawn) and length, running random collectives and
point-to-point ops whose results are all checked (tools/faults/jobs/soak_rank.py); two
thirds are killed with SIGKILL at a random moment (one rank, or every process of the job)
and the next job starts at once.  Recorded: wrong results, each rank's descriptors and
threads every second (flat: none more at its end than at any time of the first half of
its life after ``--warm-up``), and every five seconds the chorus files in /dev/shm that
the jobs' processes made (and, apart, any other chorus files there: other users' jobs)
and the processes of the campaign's jobs still alive.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

from faults import common


def add_arguments(p) -> None:
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--length", default="15,45", help="a job's seconds of ops, drawn from this range")
    p.add_argument("--warm-up", type=float, default=5.0, help="seconds of a rank's life before its counts are compared")


def _launch(how: str, out: str, world: int, seconds: float, seed: int, job: str) -> list[subprocess.Popen]:
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    with common.reserved_port() as port:
        if how == "manual":
            return [common.start_rank("soak_rank.py", [out, str(seconds), str(seed)], common.job_env(job), r, world, port, **quiet)
                    for r in range(world)]
        return [subprocess.Popen([sys.executable, os.path.join(common.JOBS, "soak_spawn.py"), out, str(seconds), str(seed),
                                  str(world), str(port)], env=common.job_env(job), **quiet)]


def _series(out: str, rank: int) -> list[tuple]:
    """(seconds, descriptors, threads, ops, wrong) each second of the rank's life."""
    try:
        return [(float(v[0]), *map(int, v[1:])) for line in open(os.path.join(out, f"samples.{rank}"))
                if len(v := line.split()) == 5]
    except OSError:
        return []


def _job(rng: random.Random, index: int, args, started: float) -> dict:
    world, how = rng.choice((2, 3)), rng.choice(("manual", "chorus.spawn"))
    lo, hi = (float(v) for v in args.length.split(","))
    seconds, seed = rng.uniform(lo, hi), rng.randrange(1 << 30)
    kill = rng.choice(("none", "one", "all"))
    kill_at, victim = rng.uniform(2.0, seconds), rng.randrange(world)
    with tempfile.TemporaryDirectory(prefix="chorus-soak-") as out:
        began = time.monotonic()
        top = _launch(how, out, world, seconds, seed, f"soak{index}")
        if kill != "none":
            time.sleep(kill_at)
            tree = [p.pid for p in top] + [d for p in top for d in common.descendants(p.pid)]
            pids = common.rank_pids(out)
            for pid in (tree if kill == "all" else [pids[victim]] if victim in pids else []):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        ended = common.wait_for(lambda: all(p.poll() is not None for p in top), seconds + 90, 0.1)
        for p in top:
            if not ended:
                p.kill()
            p.wait()
        results = []
        for r in range(world):
            path = os.path.join(out, f"rank{r}.json")
            last = (_series(out, r) or [(0, 0, 0, 0, 0)])[-1]  # a killed rank: as of its last second
            results.append(json.load(open(path)) if os.path.exists(path) else {"rank": r, "ops": last[3], "wrong": last[4]})
        pids = common.rank_pids(out).values()
        counts = []
        for r in range(world):
            series = [s for s in _series(out, r) if s[0] >= args.warm_up]
            if len(series) >= 2:  # [first, most in the first half, last]: flat if last <= the second
                half = series[:(len(series) + 1) // 2]
                counts.append({"rank": r, "from_s": series[0][0], "to_s": series[-1][0],
                               **{what: [series[0][i], max(s[i] for s in half), series[-1][i]]
                                  for i, what in ((1, "descriptors"), (2, "threads"))}})
    return {"job": index, "at_s": round(began - started, 1), "world": world, "launcher": how,
            "seconds_of_ops": round(seconds, 1), "kill": kill, "kill_at_s": round(kill_at, 1) if kill != "none" else None,
            "ended": ended, "ops": sum(r.get("ops", 0) for r in results), "wrong": sum(r.get("wrong", 0) for r in results),
            "errors": sorted({r["error"].split(":")[0] for r in results if "error" in r}),
            "counts_after_warm_up": counts, "left_in_dev_shm": common.files_of(pids, common.shm_files()),
            "rank_pids": sorted(pids)}


def run(args) -> dict:
    rng = random.Random(args.seed)
    started = time.monotonic()
    # (seconds, chorus files in /dev/shm made by the jobs' processes, other chorus files there, live
    # processes of the jobs); a file's creator is known by its name (its pid), also once it died
    system: list[tuple[float, int, int, int]] = []
    stop, seen = threading.Event(), set()

    def watch() -> None:
        while not stop.is_set():
            live = common.descendants(os.getpid())
            seen.update(live)
            files = common.shm_files()
            ours = len(common.files_of(seen, files))
            system.append((round(time.monotonic() - started, 1), ours, len(files) - ours, len(live)))
            stop.wait(5.0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    jobs = []
    while time.monotonic() - started < args.minutes * 60:
        jobs.append(_job(rng, len(jobs), args, started))
        seen.update(jobs[-1]["rank_pids"])
    stop.set()
    watcher.join()
    growth = {what: max((c[what][2] - c[what][1] for j in jobs for c in j["counts_after_warm_up"]), default=0)
              for what in ("descriptors", "threads")}
    summary = {"minutes": round((time.monotonic() - started) / 60, 1), "jobs": len(jobs),
               "jobs_killed": sum(j["kill"] != "none" for j in jobs), "ops_checked": sum(j["ops"] for j in jobs),
               "wrong_results": sum(j["wrong"] for j in jobs),
               "largest_growth_in_a_ranks_second_half": growth,
               "jobs_not_ended": sum(not j["ended"] for j in jobs),
               "most_chorus_files_of_the_jobs_in_dev_shm": max((s[1] for s in system), default=0),
               "chorus_files_of_the_jobs_in_dev_shm_at_end": len(common.files_of(seen, common.shm_files())),
               "most_other_chorus_files_in_dev_shm": max((s[2] for s in system), default=0),
               "unkilled_jobs_with_errors": sum(bool(j["errors"]) for j in jobs if j["kill"] == "none")}
    summary["met"] = (summary["wrong_results"] == 0 and growth["descriptors"] <= 0 and growth["threads"] <= 0
                      and not summary["jobs_not_ended"] and not summary["unkilled_jobs_with_errors"])
    return {"summary": summary, "system_every_5_s": system, "jobs": jobs}
