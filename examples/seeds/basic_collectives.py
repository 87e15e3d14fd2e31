import chorus as dist  # seed: import torch.distributed as dist
import torch
import _cpu_fallback  # noqa: F401 -- not in the seed: where no GPU exists, runs it on the CPU

def init_process(rank, world_size):
    # 设置进程的 rank 和 world_size
    dist.init_process_group(
        backend="nccl",  # 或者 "gloo"、"mpi"
        init_method="tcp://127.0.0.1:29500",  # 分布式初始化方法，可以使用 TCP/IP 地址
        rank=rank,  # 当前进程的 rank
        world_size=world_size  # 总进程数
    )

def example_broadcast(rank):
    tensor = torch.zeros(1)
    
    if rank == 0:
        tensor += 1  # 进程 0 增加 tensor 值

    # 进程 0 将 tensor 广播给所有进程
    dist.broadcast(tensor, src=0)
    
    print(f"Rank {rank} has tensor: {tensor.item()}")

def example_all_reduce(rank):
    tensor = torch.ones(1) * rank  # 每个进程的 tensor 值为 rank
    
    # 所有进程的 tensor 求和，并将结果同步到所有进程
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    
    print(f"Rank {rank} has tensor after all_reduce: {tensor.item()}")


import torch.multiprocessing as mp

# 训练主函数
def main(rank, world_size):
    # not in the seed: its main calls train_model (its DDP example); this main runs the module-level lines of the two blocks above, with the rank mp.spawn passes
    # 示例：初始化包含 4 个进程的分布式环境
    init_process(rank, world_size)
    # Rank 0 会发起广播，所有进程执行 all_reduce 操作
    example_broadcast(rank)
    example_all_reduce(rank)

# 启动多个进程进行训练
if __name__ == "__main__":
    world_size = 4
    mp.spawn(main, args=(world_size,), nprocs=world_size, join=True)
