"""The first collectives: broadcast from rank 0, then an all-reduce of the ranks.

Seed: 001_5fc9b1909656c151.txt, "基本 API 使用" (init_process, example_broadcast,
example_all_reduce), started with mp.spawn as in its "启动多进程训练" section.  The seed
picks "nccl"; this CPU version uses "gloo", one of the backends it lists.
Run:  python examples/seeds/basic_collectives.py

Every rank prints tensor 1.0 after the broadcast and 6.0 after the all-reduce
(0 + 1 + 2 + 3).
"""

import os

import torch

import chorus as dist  # torch: import torch.distributed as dist
import chorus as mp  # torch: import torch.multiprocessing as mp

MASTER_PORT = os.environ.get("MASTER_PORT", "29500")  # the seed's port, unless a test picks one


def init_process(rank, world_size):
    # this process's rank and the number of processes
    dist.init_process_group(
        backend="gloo",  # the seed: "nccl" (or "gloo", "mpi")
        init_method="tcp://127.0.0.1:" + MASTER_PORT,  # rank 0's address
        rank=rank,
        world_size=world_size,
    )


def example_broadcast(rank):
    tensor = torch.zeros(1)

    if rank == 0:
        tensor += 1  # only rank 0 changes its tensor

    # rank 0's tensor goes to everybody
    dist.broadcast(tensor, src=0)

    print(f"Rank {rank} has tensor: {tensor.item()}")


def example_all_reduce(rank):
    tensor = torch.ones(1) * rank  # every rank holds its rank

    # sum over all ranks, the result on every rank
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    print(f"Rank {rank} has tensor after all_reduce: {tensor.item()}")


def main(rank, world_size):
    init_process(rank, world_size)
    example_broadcast(rank)
    example_all_reduce(rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = 4
    mp.spawn(main, args=(world_size,), nprocs=world_size, join=True)
