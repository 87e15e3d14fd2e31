# torchrun --standalone --nnodes=1 --nproc-per-node="cpu" torchrun.py

import os

local_rank = int(os.environ["LOCAL_RANK"])
print(f'LOCAL_RANK: {local_rank}')

if local_rank == 0:
    print('world_size:', os.environ["WORLD_SIZE"])
