"""A script for the launcher: every rank joins through env://, all-reduces its rank
and meets the others at a barrier.

Seed: 002_ae7205c92d7eeded.txt, "入门 / 多线程创建 / torchrun".  The seed uses the nccl
backend and CUDA tensors; this CPU version uses "gloo" and CPU tensors (the seed's
own alternative backend), so ``torch.cuda.set_device`` is left out.
Run:  python -m chorus.run --nproc-per-node=4 --master_port=29501 examples/seeds/torchrun_all_reduce.py

Every rank prints x = 6.0 (0 + 1 + 2 + 3); rank 0 also prints world_size = 4.
"""

import os

import torch

import chorus as dist  # torch: import torch.distributed as dist


def main():
    # 1. join the job: the launcher put MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE in
    #    the environment, env:// reads them
    dist.init_process_group(
        backend="gloo",  # the seed: "nccl" (GPUs)
        init_method="env://",
    )

    # 2. who am I
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])  # the seed binds its GPU with it

    # 3. a tensor that differs on every rank
    x = torch.tensor([rank], dtype=torch.float32)  # the seed: device="cuda"

    # 4. all-reduce: everybody gets the sum
    dist.all_reduce(x, op=dist.ReduceOp.SUM)

    # 5. barrier: wait for everybody
    dist.barrier()

    if rank == 0:
        print(f"world_size = {world_size}")

    print(f"rank {rank}: after all_reduce, x = {x.item()}")
    assert local_rank == rank  # one node: local and global ranks coincide

    # 6. leave the job
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
