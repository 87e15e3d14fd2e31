"""Reductions: all_reduce (SUM, MAX) and reduce to rank 0 -- then an all-reduce by hand
with rank 0 as a parameter server.

Seed: 004_2a19141315c547ad.txt, section 5 "Reduce 规约" (fun_reduce.py: the API version
``run`` and the P2P version ``p2p_reduce``).
Run:  python examples/seeds/reduce.py          (twice 4 processes, started like mp.spawn)

Rank r starts with 2 * r, so on 4 ranks:

    all_reduce SUM:    every rank tensor([12.])      (0 + 2 + 4 + 6)
    all_reduce MAX:    every rank tensor([6.])
    reduce to rank 0:  rank 0 tensor([12.]); the other ranks' tensors are not part of
                       the result (chorus leaves them as they were: 2, 4, 6)
    p2p_reduce:        every rank tensor([12., 12.])

SEED_PAUSE=0 skips the seed's one-second pauses (the tests do).
"""

import os
import time

import torch

import chorus as dist  # torch: import torch.distributed as dist
import chorus as mp  # torch: import torch.multiprocessing as mp

MASTER_PORT = os.environ.get("MASTER_PORT", "12801")  # the seed's port, unless a test picks one
PAUSE = float(os.environ.get("SEED_PAUSE", "1"))


def run(rank, master_addr, master_port, world_size, backend="gloo"):
    """The API: all_reduce with SUM and MAX, reduce into rank 0."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)

    # all_reduce SUM: every rank ends with the same sum
    tensor = torch.ones(1) * 2 * rank
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    print("Rank", rank, "all_reduce SUM:", tensor)

    # all_reduce MAX
    tensor = torch.ones(1) * 2 * rank
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    print("Rank", rank, "all_reduce MAX:", tensor)

    time.sleep(PAUSE)

    # reduce: only dst=0 gets the result
    tensor = torch.ones(1) * 2 * rank
    dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
    print("Rank", rank, "reduce to rank 0:", tensor)

    dist.destroy_process_group()


def p2p_reduce(rank, master_addr, master_port, world_size, backend="gloo"):
    """By hand: rank 0 collects and sums everybody's tensor (a parameter server), then
    broadcasts the sum back to all ranks."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)
    group = dist.new_group(ranks=[0, 1, 2, 3])

    tensor = torch.ones(2) * rank * 2
    tensor_sum = torch.ones(2) * rank * 2
    time.sleep(PAUSE)

    # step 1: rank 0 receives from every other rank and accumulates
    if dist.get_rank() == 0:
        ranks = dist.get_process_group_ranks(group)
        tmp = torch.zeros(2)
        for r in ranks:
            if r != 0:
                dist.recv(tensor=tmp, src=r)
                tensor_sum += tmp
    elif rank != 0:
        dist.send(tensor=tensor, dst=0)

    # step 2: everybody gets rank 0's sum
    dist.broadcast(tensor_sum, src=0)
    print("Rank", rank, "has data", tensor_sum)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
    mp.spawn(p2p_reduce, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
