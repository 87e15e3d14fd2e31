"""Jobs killed with SIGKILL at random moments under every launcher: does any chorus file
stay in /dev/shm?

Each launcher (torchrun, chorus.spawn, torch's mp.spawn, ranks started by hand) first runs
the job (tools/faults/jobs/kill_job.py) once unkilled, which times it; then ``--jobs``
jobs, the launchers in turn, are each killed at a moment drawn uniformly over that time
(``--seed``): one rank (``one``: its peers must fail and the launcher end) or every
process of the job, launcher included (``all``: nothing of the job runs any clean-up).
After each job, the chorus files in /dev/shm that its ranks created (their names carry
the creator's pid) are listed; at the start and the end all chorus files are, at the
end also after a new process swept those of dead creators, as the next chorus job on
the host does.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from faults.common import (
    JOBS,
    descendants,
    files_of,
    job_env,
    rank_pids,
    reserved_port,
    shm_files,
    start_rank,
    wait_for,
)

LAUNCHERS = ("torchrun", "chorus.spawn", "mp.spawn", "manual")


def add_arguments(p) -> None:
    p.add_argument("--jobs", type=int, default=40, help="killed jobs, the launchers in turn")
    p.add_argument("--launchers", default=",".join(LAUNCHERS))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seconds", type=float, default=2.0, help="how long each job runs its ops")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=20.0, help="the job's set-up and op timeout (seconds)")
    p.add_argument("--grace", type=float, default=60.0, help="seconds a killed job may take to end")


def _launch(launcher: str, out: str, args, env: dict) -> list[subprocess.Popen]:
    """The job's top-level processes: the launcher, or the ranks started by hand."""
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    job_args = [out, str(args.seconds), str(args.timeout)]
    if launcher == "torchrun":
        return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc-per-node={args.world}", os.path.join(JOBS, "kill_job.py"), *job_args],
                                 env=env, **quiet)]
    with reserved_port() as port:
        if launcher == "manual":
            return [start_rank("kill_job.py", job_args, env, r, args.world, port, **quiet) for r in range(args.world)]
        how = "torch" if launcher == "mp.spawn" else "chorus"
        return [subprocess.Popen([sys.executable, os.path.join(JOBS, "kill_spawn.py"), how, *job_args,
                                  str(args.world), str(port)], env=env, **quiet)]


def _pid(out: str, rank: int) -> int | None:
    return rank_pids(out).get(rank)


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run_job(launcher: str, args, mode: str | None, kill_at: float, victim: int) -> dict:
    job = "kills" + os.urandom(4).hex()
    with tempfile.TemporaryDirectory(prefix="chorus-kills-") as out:
        began = time.monotonic()
        top = _launch(launcher, out, args, job_env(job))
        row = {"launcher": launcher, "mode": mode or "none"}
        if mode is not None:
            time.sleep(max(0.0, kill_at - (time.monotonic() - began)))
            tree = [p.pid for p in top] + [d for p in top for d in descendants(p.pid)]
            if mode == "all":
                _kill(tree)
                phase = "ops" if os.path.exists(os.path.join(out, "ready.0")) else "set-up"
            else:
                phase = ("ops" if os.path.exists(os.path.join(out, f"ready.{victim}"))
                         else "set-up" if _pid(out, victim) else "start")
                wait_for(lambda: _pid(out, victim) is not None, 30)  # not started yet: at its start
                _kill([_pid(out, victim)] if _pid(out, victim) else [])
            row.update(victim=victim if mode == "one" else "all", kill_at_s=round(time.monotonic() - began, 2),
                       phase=phase)
        killed_at = time.monotonic()
        ended = wait_for(lambda: all(p.poll() is not None for p in top), args.grace, 0.02)
        if not ended:
            _kill([p.pid for p in top] + [d for p in top for d in descendants(p.pid)])
        for p in top:
            p.wait()
        wait_for(lambda: not any(descendants(p.pid) for p in top), 5)
        row.update(ended=ended, seconds=round(time.monotonic() - began, 2),
                   end_after_kill_s=round(time.monotonic() - killed_at, 2) if mode else None,
                   exit_codes=[p.returncode for p in top],
                   errors=sorted({open(os.path.join(out, f)).read().split(":")[0]
                                  for f in os.listdir(out) if f.startswith("error.")}),
                   left_in_dev_shm=files_of(rank_pids(out).values(), shm_files()))  # made by its ranks
    return row


def run(args) -> dict:
    rng = random.Random(args.seed)
    launchers = args.launchers.split(",")
    before = shm_files()
    timing = {launcher: _run_job(launcher, args, None, 0.0, 0) for launcher in launchers}
    jobs = []
    for i in range(args.jobs):
        launcher = launchers[i % len(launchers)]
        mode = rng.choice(("one", "all"))
        jobs.append(_run_job(launcher, args, mode, rng.uniform(0.0, timing[launcher]["seconds"]),
                             rng.randrange(args.world)))
    at_end = shm_files()
    subprocess.run([sys.executable, "-c", "from chorus.host.segment import sweep_dead; sweep_dead()"],
                   env=job_env("sweep"), check=True)
    after_sweep = shm_files()
    left = sorted({f for j in jobs for f in j["left_in_dev_shm"]})
    summary = {"jobs_killed": len(jobs), "by_launcher": {n: sum(j["launcher"] == n for j in jobs) for n in launchers},
               "killed_in_set_up": sum(j.get("phase") in ("start", "set-up") for j in jobs),
               "jobs_that_left_files": sum(bool(j["left_in_dev_shm"]) for j in jobs),
               "files_left_by_jobs": left, "chorus_files_before": before, "chorus_files_at_end": at_end,
               "chorus_files_after_a_sweep": after_sweep,
               "jobs_not_ended_within_grace": sum(not j["ended"] for j in jobs),
               "unkilled_runs_clean": all(t["exit_codes"] == [0] * len(t["exit_codes"]) and not t["left_in_dev_shm"]
                                          for t in timing.values())}
    summary["met"] = not left and not at_end and summary["unkilled_runs_clean"] and not summary[
        "jobs_not_ended_within_grace"]
    return {"summary": summary, "unkilled": timing, "jobs": jobs}
