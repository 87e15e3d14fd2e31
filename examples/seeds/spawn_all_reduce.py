import os
import torch
import chorus as dist  # seed: import torch.distributed as dist
import _cpu_fallback  # noqa: F401 -- not in the seed: where no GPU exists, runs it on the CPU
import torch.multiprocessing as mp


def worker(rank, world_size):
    # 1. 初始化进程组
    dist.init_process_group(
        backend="nccl",
        init_method="tcp://127.0.0.1:29501",
        rank=rank,
        world_size=world_size,
    )

    # 2. 绑定 GPU（一进程一卡）
    torch.cuda.set_device(rank)

    # 3. 构造一个张量
    x = torch.tensor([rank], device="cuda", dtype=torch.float32)

    # 4. All-Reduce
    dist.all_reduce(x, op=dist.ReduceOp.SUM)

    # 5. Barrier
    dist.barrier()

    if rank == 0:
        print(f"world_size = {world_size}")

    print(f"rank {rank}: after all_reduce, x = {x.item()}")

    # 6. 销毁进程组
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = 4

    # 必须在 main 里
    mp.set_start_method("spawn", force=True)

    # 创建进程
    mp.spawn(
        worker,
        args=(world_size,),
        nprocs=world_size,
        join=True,
    )
