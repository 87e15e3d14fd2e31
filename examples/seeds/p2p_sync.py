"""Synchronous point-to-point: rank 0 sends one tensor to rank 1.

Seed: 004_2a19141315c547ad.txt, section 2 "P2P 同步通信" (p2p.py).
Run:  python examples/seeds/p2p_sync.py        (4 processes, started like mp.spawn)

Rank 1 prints tensor(1.); ranks 0, 2 and 3 print tensor(0.) (rank 0 takes its 1 back
after the send returned).
"""

import os

import torch

import chorus as dist  # torch: import torch.distributed as dist
import chorus as mp  # torch: import torch.multiprocessing as mp

MASTER_PORT = os.environ.get("MASTER_PORT", "12801")  # the seed's port, unless a test picks one


def run(rank, master_addr, master_port, world_size, backend="gloo"):
    """rank 0 --send--> rank 1; send and recv both block until the transfer is done."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)

    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)  # blocking send
        tensor -= 1
    elif rank == 1:
        dist.recv(tensor=tensor, src=0)  # blocking receive, written into tensor

    print("Rank", rank, "has data", tensor[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
