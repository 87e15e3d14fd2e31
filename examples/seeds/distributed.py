# ---- not in the seed: imports and the small helpers ----
# The seed explains the functions of a training project's distributed.py: it shows
# reduce_tensor, gather_tensor and broadcast_tensor (below, verbatim) but neither the
# module's imports nor the small helpers that they and the seed's scenes call.
import os

import torch
import chorus as dist  # seed: import torch.distributed as dist


def is_distributed():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    return dist.get_rank() if is_distributed() else 0


def get_world_size():
    return dist.get_world_size() if is_distributed() else 1


def is_main_process():
    return get_rank() == 0


def get_device():
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def barrier():
    if is_distributed():
        dist.barrier()


def init_distributed():
    """Join the job when started by torchrun (RANK set); otherwise stay one process."""
    if "RANK" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(get_device())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def cleanup():
    if is_distributed():
        dist.destroy_process_group()


# ---- seed: 2.4 代码实现解析 ----
def reduce_tensor(tensor, op="mean"):
    if not is_distributed():
        return tensor  # 单GPU直接返回
    
    # 克隆避免修改原始数据
    tensor = tensor.clone()
    
    # 执行all_reduce：所有进程参与，结果广播给所有进程
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    
    # 如果要求平均值，除以进程数
    if op == "mean":
        tensor = tensor / get_world_size()
    
    return tensor


# ---- seed: 3.4 代码实现解析 ----
def gather_tensor(tensor, dst=0):
    if not is_distributed():
        return [tensor]  # 单GPU返回列表形式
    
    world_size = get_world_size()
    
    if get_rank() == dst:
        # 目标进程：准备接收缓冲区
        tensor_list = [torch.zeros_like(tensor) for _ in range(world_size)]
        dist.gather(tensor, tensor_list, dst=dst)
        return tensor_list  # 返回所有进程的张量列表
    else:
        # 其他进程：发送数据
        dist.gather(tensor, dst=dst)
        return None  # 非目标进程返回None


# ---- seed: 4.4 代码实现解析 ----
def broadcast_tensor(tensor, src=0):
    if not is_distributed():
        return tensor  # 单GPU直接返回
    
    # PyTorch的broadcast会就地修改tensor
    # 源进程的数据会被复制到所有其他进程
    dist.broadcast(tensor, src=src)
    
    return tensor
