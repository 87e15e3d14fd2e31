"""Start soak_rank.job on W ranks with chorus.spawn.

usage: soak_spawn.py OUT SECONDS SEED W PORT
"""

import sys

from soak_rank import job

if __name__ == "__main__":
    out, seconds, seed, world, port = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    import chorus

    chorus.spawn(job, args=(world, out, seconds, seed, port), nprocs=world)
