"""Sub-groups: two groups [0, 1] and [2, 3], an all-reduce inside each.

Seed: 000_8bfd9a46bf105215.txt, section 5 "进阶：进程组管理 (Groups)" (the new_group
example; the seed leaves out where ``tensor`` comes from: here it holds the rank, and
the ranks of the second group all-reduce in theirs too).
Run:  python -m chorus.run --nproc-per-node=4 examples/seeds/subgroups.py

Every rank calls new_group for both groups (in the same order), members or not.
Ranks 0 and 1 print 1.0 (0 + 1), ranks 2 and 3 print 5.0 (2 + 3).
"""

import torch

import chorus as dist  # torch: import torch.distributed as dist


def main():
    dist.init_process_group("gloo")  # env://: World Size = 4
    rank = dist.get_rank()
    tensor = torch.ones(1) * rank

    # two sub-groups: [0, 1] and [2, 3]
    group1 = dist.new_group([0, 1])
    group2 = dist.new_group([2, 3])

    # all-reduce inside one's own group only
    if dist.get_rank() in [0, 1]:
        dist.all_reduce(tensor, group=group1)
    else:
        dist.all_reduce(tensor, group=group2)

    print(f"rank {rank}: all_reduce in its group = {tensor.item()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
