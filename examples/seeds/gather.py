"""Gathering: all_gather into a list, all_gather_into_tensor, all_gather_object -- then
an all-gather by hand (gather to rank 0 with send/recv, concatenate, broadcast).

Seed: 004_2a19141315c547ad.txt, section 6 "Gather 收集" (fun_gather.py: the API version
``run`` and the P2P version ``p2p_gather``).
Run:  python examples/seeds/gather.py          (twice 4 processes, started like mp.spawn)

Rank r contributes [2r + 1, 2r + 2], so on 4 ranks every rank gets
[1, 2], [3, 4], [5, 6], [7, 8] (as a list, or as one tensor 1..8), and the objects
['foo', 12, {1: 2}, 'xiaodongguaAIGC'].

SEED_PAUSE=0 skips the seed's one-second pause (the tests do).
"""

import os
import time

import torch

import chorus as dist  # torch: import torch.distributed as dist
import chorus as mp  # torch: import torch.multiprocessing as mp

MASTER_PORT = os.environ.get("MASTER_PORT", "12801")  # the seed's port, unless a test picks one
PAUSE = float(os.environ.get("SEED_PAUSE", "1"))


def run(rank, master_addr, master_port, world_size, backend="gloo"):
    """The API: all_gather, all_gather_into_tensor, all_gather_object."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)

    # all_gather: one output tensor per rank
    tensor_list = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    dist.all_gather(tensor_list=tensor_list, tensor=tensor)
    print("Rank", rank, "all_gather:", tensor_list)

    # all_gather_into_tensor: the blocks land side by side in one big tensor
    tensor_trg = torch.zeros(2 * world_size, dtype=torch.int64)
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    dist.all_gather_into_tensor(output_tensor=tensor_trg, input_tensor=tensor)
    print("Rank", rank, "all_gather_into_tensor:", tensor_trg)

    time.sleep(PAUSE)

    # all_gather_object: any picklable object
    gather_objects = ["foo", 12, {1: 2}, "xiaodongguaAIGC"]
    output = [None for _ in gather_objects]
    dist.all_gather_object(output, gather_objects[rank])
    print(f"rank:{rank}", output)

    dist.destroy_process_group()


def p2p_gather(rank, master_addr, master_port, world_size, backend="gloo"):
    """By hand: an all_gather_into_tensor out of send/recv and one broadcast."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)
    group = dist.new_group(ranks=[0, 1, 2, 3])

    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    tensor_trg = torch.arange(2 * world_size)
    tensor_list = [torch.arange(2, dtype=torch.int64) for _ in range(world_size)]

    # step 1: rank 0 receives every rank's block
    if rank == 0:
        tensor_list[0] = tensor
        ranks = dist.get_process_group_ranks(group)
        for r in ranks:
            if r != 0:
                dist.recv(tensor_list[r], src=r)
    else:
        dist.send(tensor, dst=0)

    # step 2: rank 0 concatenates them
    if rank == 0:
        tensor_trg = torch.concat(tensor_list, dim=0)

    # step 3: and hands the whole result to everybody
    dist.broadcast(tensor_trg, src=0)
    print(f"rank:{rank} all-gather result", tensor_trg)

    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
    mp.spawn(p2p_gather, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
