# ---- not in the seed: imports, a job (torchrun's env://), the tensor ----
import torch
import chorus as dist  # seed: import torch.distributed as dist

dist.init_process_group("gloo")
tensor = torch.ones(1) * dist.get_rank()

# ---- seed: 5. 进阶：进程组管理 (Groups), 示例 ----
# 假设 World Size = 4
# 创建两个子组：[0, 1] 和 [2, 3]
group1 = dist.new_group([0, 1])
group2 = dist.new_group([2, 3])

# 仅在组内进行 all_reduce
if dist.get_rank() in [0, 1]:
    dist.all_reduce(tensor, group=group1)

# ---- not in the seed: what the ranks hold now ----
print(f"rank {dist.get_rank()}: tensor = {tensor.item()}")
dist.destroy_process_group()
