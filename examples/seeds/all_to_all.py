"""All-to-all: rank i sends its j-th block to rank j (a transpose of the blocks) --
with all_to_all_single on one tensor, all_to_all on lists, and uneven blocks.

Seed: 004_2a19141315c547ad.txt, section 9 "AllToAll 全交换" (fun_all2all.py).
Run:  python examples/seeds/all_to_all.py      (three times 4 processes, like mp.spawn)

    run_single:         rank r holds [4r, 4r+1, 4r+2, 4r+3] and receives element r of
                        every rank: rank 0 gets [0, 4, 8, 12], rank 1 [1, 5, 9, 13], ...
    run_list:           the same with lists of one-element tensors (the seed defines it
                        without launching it; it is launched here too)
    run_variable_size:  uneven blocks, as MoE token routing does: input_splits[r][j]
                        elements go from rank r to rank j, so rank j receives column j
                        of input_splits (output_splits = input_splits.t()).
"""

import os

import torch

import chorus as dist  # torch: import torch.distributed as dist
import chorus as mp  # torch: import torch.multiprocessing as mp

MASTER_PORT = os.environ.get("MASTER_PORT", "12801")  # the seed's port, unless a test picks one


def run_single(rank, master_addr, master_port, world_size, backend="gloo"):
    """all_to_all_single: one input tensor, cut into world_size equal blocks."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)

    input = torch.arange(4) + rank * 4
    output = torch.empty([4], dtype=torch.int64)
    dist.all_to_all_single(output, input)
    print("Rank", rank, "input:", input, "→ output:", output)
    dist.destroy_process_group()


def run_list(rank, master_addr, master_port, world_size, backend="gloo"):
    """all_to_all: a list of input tensors, one per destination rank."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)

    input = torch.arange(4) + rank * 4
    input = list(input.chunk(4))
    output = list(torch.empty([4], dtype=torch.int64).chunk(4))
    dist.all_to_all(output, input)
    print("Rank", rank, "output:", output)
    dist.destroy_process_group()


def run_variable_size(rank, master_addr, master_port, world_size, backend="gloo"):
    """all_to_all_single with uneven blocks (input_split_sizes / output_split_sizes)."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)

    input = [torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int64),
             torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 18], dtype=torch.int64),
             torch.tensor([20, 21, 22, 23, 24], dtype=torch.int64),
             torch.tensor([30, 31, 32, 33, 34, 35, 36], dtype=torch.int64)]

    # row r: how many elements rank r sends to rank 0, 1, 2, 3
    input_splits = torch.tensor([[2, 2, 1, 1],
                                 [3, 2, 2, 2],
                                 [2, 1, 1, 1],
                                 [2, 2, 2, 1]], dtype=torch.int64)
    output_splits = input_splits.t()
    output = [torch.zeros(torch.sum(output_splits[i, :]), dtype=torch.int64)
              for i in range(world_size)]

    dist.all_to_all_single(output=output[rank], input=input[rank],
                           output_split_sizes=output_splits[rank, :].tolist(),
                           input_split_sizes=input_splits[rank, :].tolist())
    print("Rank", rank, "variable output:", output[rank])
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run_single, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
    mp.spawn(run_list, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
    mp.spawn(run_variable_size, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
