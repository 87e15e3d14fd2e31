"""Starting the processes yourself: spawn four workers that join through tcp://,
all-reduce their rank and meet at a barrier.

Seed: 002_ae7205c92d7eeded.txt, "入门 / 多线程创建 / mp".  The seed uses the nccl backend
and CUDA tensors; this CPU version uses "gloo" and CPU tensors, so
``torch.cuda.set_device`` is left out.
Run:  python examples/seeds/spawn_all_reduce.py

Every rank prints x = 6.0; rank 0 also prints world_size = 4.
"""

import multiprocessing
import os

import torch

import chorus as dist  # torch: import torch.distributed as dist
import chorus as mp  # torch: import torch.multiprocessing as mp

MASTER_PORT = os.environ.get("MASTER_PORT", "29501")  # the seed's port, unless a test picks one


def worker(rank, world_size):
    # 1. join the job at rank 0's address
    dist.init_process_group(
        backend="gloo",  # the seed: "nccl" (GPUs)
        init_method="tcp://127.0.0.1:" + MASTER_PORT,
        rank=rank,
        world_size=world_size,
    )

    # 2. (the seed binds one GPU per process here: torch.cuda.set_device(rank))

    # 3. a tensor that differs on every rank
    x = torch.tensor([rank], dtype=torch.float32)  # the seed: device="cuda"

    # 4. all-reduce
    dist.all_reduce(x, op=dist.ReduceOp.SUM)

    # 5. barrier
    dist.barrier()

    if rank == 0:
        print(f"world_size = {world_size}")

    print(f"rank {rank}: after all_reduce, x = {x.item()}")

    # 6. leave the job
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = 4

    # fresh interpreters for the workers (the seed calls mp.set_start_method, which is
    # this same standard-library function re-exported by torch.multiprocessing)
    multiprocessing.set_start_method("spawn", force=True)

    mp.spawn(
        worker,
        args=(world_size,),
        nprocs=world_size,
        join=True,
    )
