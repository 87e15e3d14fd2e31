"""Each rank writes its pid to PID_DIR/<rank>.pid, then one rank misbehaves, others sleep.

usage: ranks_behave.py PID_DIR [--fail-rank R] [--mode raise|sigkill] [--stubborn-rank S]

The failing rank waits until every rank's pid file exists, writes the time of its
failure to PID_DIR/failed_at, then raises (through a few frames) or SIGKILLs itself.
The stubborn rank ignores SIGTERM, so only SIGKILL stops it.
"""

import argparse
import os
import signal
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("pid_dir")
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--mode", default="raise")
p.add_argument("--stubborn-rank", type=int, default=-1)
a = p.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if rank == a.stubborn_rank:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(a.pid_dir, f"{rank}.pid.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(a.pid_dir, f"{rank}.pid.tmp"), os.path.join(a.pid_dir, f"{rank}.pid"))


def inner_step():
    raise ValueError(f"boom from rank {rank}")


def outer_step():
    inner_step()


if rank == a.fail_rank:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(a.pid_dir, f"{r}.pid")) for r in range(world)):
            break
        time.sleep(0.02)
    print(f"rank {rank} is about to fail", file=sys.stderr)
    with open(os.path.join(a.pid_dir, "failed_at"), "w") as f:
        f.write(repr(time.time()))
    if a.mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    outer_step()
time.sleep(60)
