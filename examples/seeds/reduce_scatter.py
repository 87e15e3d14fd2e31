"""Reduce-scatter: sum everybody's tensor, give rank i only block i of the sum -- with
reduce_scatter_tensor (flat and stacked input), then by hand (reduce to rank 0, send
the blocks out).

Seed: 004_2a19141315c547ad.txt, section 7 "ReduceScatter 规约分散"
(fun_reduce_scatter.py: the API version ``run`` and the P2P version
``p2p_reduce_scatter``).
Run:  python examples/seeds/reduce_scatter.py  (twice 4 processes, started like mp.spawn)

Every rank holds arange(8) = [0, 1, ..., 7]; the sum over 4 ranks is [0, 4, ..., 28],
so rank i gets [8i, 8i + 4]: rank 0 [0, 4], rank 1 [8, 12], rank 2 [16, 20],
rank 3 [24, 28] (as [[...]] for the stacked form).

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
    """The API.  ZeRO-2 uses this: reduce the gradients, and every rank keeps (and
    optimises) only its own slice."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)

    # flat input: world_size blocks of 2 side by side
    tensor_out = torch.zeros(2, dtype=torch.int64)
    tensor_in = torch.arange(world_size * 2, dtype=torch.int64)
    dist.reduce_scatter_tensor(tensor_out, tensor_in, op=dist.ReduceOp.SUM)
    print("Rank", rank, "reduce_scatter:", tensor_out)

    time.sleep(PAUSE)

    # stacked input: one row per rank
    tensor_in = torch.reshape(
        torch.arange(world_size * 2, dtype=torch.int64), (world_size, 2))
    tensor_out = torch.zeros(1, 2, dtype=torch.int64)
    dist.reduce_scatter_tensor(tensor_out, tensor_in)
    print("Rank", rank, "reduce_scatter (stack):", tensor_out)

    dist.destroy_process_group()


def p2p_reduce_scatter(rank, master_addr, master_port, world_size, backend="gloo"):
    """By hand: rank 0 sums everything, then sends block r to rank r."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)
    group = dist.new_group(ranks=[0, 1, 2, 3])

    tensor_out = torch.zeros(2, dtype=torch.int64)
    tensor_in = torch.arange(world_size * 2, dtype=torch.int64)
    tensor_reduce = torch.arange(world_size * 2, dtype=torch.int64)

    # step 1: rank 0 receives every other rank's input and adds it up
    if rank == 0:
        tensor_tmp = torch.zeros(world_size * 2, dtype=torch.int64)
        for r in dist.get_process_group_ranks(group):
            if r != 0:
                dist.recv(tensor_tmp, src=r)
                tensor_reduce += tensor_tmp
    else:
        dist.send(tensor_in, dst=0)

    time.sleep(PAUSE)

    # step 2: rank 0 cuts the sum into blocks and sends block r to rank r
    if rank == 0:
        scatter_list = list(tensor_reduce.split(split_size=2, dim=0))
        for r in dist.get_process_group_ranks(group):
            if r != 0:
                dist.send(scatter_list[r], dst=r)
            else:
                tensor_out = scatter_list[0]
    else:
        dist.recv(tensor_out, src=0)

    print("Rank", rank, "p2p reduce_scatter:", tensor_out)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
    mp.spawn(p2p_reduce_scatter, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
