"""Start kill_job.job on W ranks with chorus.spawn or torch's mp.spawn.

usage: kill_spawn.py chorus|torch OUT SECONDS TIMEOUT W PORT
"""

import sys

from kill_job import job

if __name__ == "__main__":
    how, out, seconds, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    world, port = int(sys.argv[5]), int(sys.argv[6])
    if how == "torch":
        import torch.multiprocessing as mp

        mp.spawn(job, args=(world, out, seconds, timeout, port), nprocs=world)
    else:
        import chorus

        chorus.spawn(job, args=(world, out, seconds, timeout, port), nprocs=world)
