"""A plain torch.distributed script (no chorus import): gloo over torch's own env://."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {t.item():g}")
dist.destroy_process_group()
