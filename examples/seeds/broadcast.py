"""Broadcast: objects, a tensor, a tensor inside a sub-group -- then the same by hand
with send/recv.

Seed: 004_2a19141315c547ad.txt, section 4 "Broadcast 广播" (fun_broadcast.py: the API
version ``run`` and the P2P version ``p2p_broadcast``).
Run:  python examples/seeds/broadcast.py       (twice 4 processes, started like mp.spawn)

    run:            every rank: ['foo', 12, {1: 2}], then tensor([100., 100.]);
                    sub-group [0, 1] with src=1: ranks 0, 1 get tensor([2., 2.]),
                    ranks 2, 3 are not members and keep tensor([4., 4.]), tensor([6., 6.])
    p2p_broadcast:  every rank: tensor([100., 100.])

The seed sleeps one second between the parts to keep the prints apart; SEED_PAUSE=0
skips that (the tests do).
"""

import os
import time

import torch

import chorus as dist  # torch: import torch.distributed as dist
import chorus as mp  # torch: import torch.multiprocessing as mp

MASTER_PORT = os.environ.get("MASTER_PORT", "12801")  # the seed's port, unless a test picks one
PAUSE = float(os.environ.get("SEED_PAUSE", "1"))


def run(rank, master_addr, master_port, world_size, backend="gloo"):
    """The API: broadcast_object_list, broadcast, broadcast in a new_group."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)

    # 1. a list of Python objects (pickled), from rank 0 to everyone
    if dist.get_rank() == 0:
        objects = ["foo", 12, {1: 2}]
    else:
        objects = [None, None, None]
    dist.broadcast_object_list(objects, src=0)
    print("Rank", rank, "has data", objects)

    time.sleep(PAUSE)

    # 2. a tensor, from rank 0 to everyone
    tensor = torch.zeros(2)
    if dist.get_rank() == 0:
        tensor = tensor + 100
    dist.broadcast(tensor, src=0)
    print("Rank", rank, "has data", tensor)

    time.sleep(PAUSE)

    # 3. inside the sub-group [0, 1] only: rank 1 -> rank 0; ranks 2 and 3 are left alone
    tensor = torch.ones(2) * rank * 2
    group = dist.new_group(ranks=[0, 1])
    dist.broadcast(tensor, src=1, group=group)
    print("Rank", rank, "has data", tensor)

    dist.destroy_process_group()


def p2p_broadcast(rank, master_addr, master_port, world_size, backend="gloo"):
    """By hand: rank 0 sends its tensor to every other rank of the group, one by one."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)
    group = dist.new_group(ranks=[0, 1, 2, 3])

    tensor = torch.zeros(2)
    if dist.get_rank() == 0:
        tensor = tensor + 100
        ranks = dist.get_process_group_ranks(group)
        for r in ranks:
            if r != 0:
                dist.send(tensor=tensor, dst=r)
    else:
        dist.recv(tensor=tensor, src=0)

    print("Rank", rank, "has data", tensor)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
    mp.spawn(p2p_broadcast, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
