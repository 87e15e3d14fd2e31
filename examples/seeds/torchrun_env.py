"""What the launcher tells every process: LOCAL_RANK, WORLD_SIZE (and RANK,
MASTER_ADDR, MASTER_PORT, ...) in the environment.

Seed: 004_2a19141315c547ad.txt, section 11 "torchrun 启动" (torchrun.py).
Run:  python -m chorus.run --standalone --nnodes=1 --nproc-per-node=4 examples/seeds/torchrun_env.py
      (chorusrun takes torchrun's flags; the seed's two-node form works the same way)

Every process prints its LOCAL_RANK (0..3); local rank 0 also prints world_size: 4.
"""

import os

local_rank = int(os.environ["LOCAL_RANK"])
print(f"LOCAL_RANK: {local_rank}")

if local_rank == 0:
    print("world_size:", os.environ["WORLD_SIZE"])
