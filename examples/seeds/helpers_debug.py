# ---- not in the seed: imports and a logger ----
import logging
import sys

import torch
import chorus as dist  # seed: import torch.distributed as dist
from distributed import (
    broadcast_tensor,
    cleanup,
    gather_tensor,
    get_device,
    get_rank,
    get_world_size,
    init_distributed,
    is_distributed,
    is_main_process,
    reduce_tensor,
)

logger = logging.getLogger("seed")  # the seed's logger: its messages, one a line, on stdout
logger.addHandler(logging.StreamHandler(sys.stdout))
logger.setLevel(logging.INFO)


# ---- seed: 7.3 调试技巧 ----
def debug_communication():
    rank = get_rank()
    
    # 测试reduce
    test_tensor = torch.tensor(rank, dtype=torch.float, device=get_device())
    reduced = reduce_tensor(test_tensor, op="sum")
    expected_sum = sum(range(get_world_size()))
    
    logger.info(f"Rank {rank}: reduce test {reduced.item()} == {expected_sum}")
    
    # 测试gather
    gathered = gather_tensor(test_tensor, dst=0)
    if is_main_process():
        logger.info(f"Gathered: {[t.item() for t in gathered]}")
    
    # 测试broadcast
    if rank == 0:
        broadcast_data = torch.tensor([1.0, 2.0, 3.0], device=get_device())
    else:
        broadcast_data = torch.zeros(3, device=get_device())
    
    broadcast_data = broadcast_tensor(broadcast_data, src=0)
    logger.info(f"Rank {rank}: broadcast result {broadcast_data}")


# ---- not in the seed: what 7.2's lines need around them ----
def other_computation():
    return sum(i * i for i in range(100_000))


def async_all_reduce():
    tensor = torch.ones(4, device=get_device()) * (get_rank() + 1)
    # ---- seed: 7.2 优化建议, 2. 异步通信（高级） ----
    # 使用异步操作重叠计算和通信
    handle = dist.all_reduce(tensor, async_op=True)
    # 在通信进行时执行其他计算
    other_computation()
    # 等待通信完成
    handle.wait()
    # ---- not in the seed ----
    logger.info(f"Rank {get_rank()}: async all_reduce {tensor.tolist()}")


if __name__ == "__main__":
    init_distributed()  # torchrun: 4 ranks; plain python: one process
    debug_communication()
    if is_distributed():  # 7.2 calls dist.all_reduce itself: it needs a job
        async_all_reduce()
    cleanup()
