"""A chorus job: init_process_group (env:// from the launcher), one all_reduce, print."""

import numpy as np

import chorus as dist

dist.init_process_group("gloo")
t = np.array([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {t[0]:g}")
dist.destroy_process_group()
