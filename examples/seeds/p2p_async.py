"""Asynchronous point-to-point: rank 0 fires ten isends at rank 2, which adds them up.

Seed: 004_2a19141315c547ad.txt, section 3 "P2P 异步通信" (p2p_async.py).
Run:  python examples/seeds/p2p_async.py       (4 processes, started like mp.spawn)

isend/irecv return at once with a request; ``wait()`` blocks until that transfer is
done.  Rank 2 ends with 0 + 1 + ... + 9 = 45, rank 0 with its last tensor (9), ranks 1
and 3 with 0.  The barrier keeps a rank that finished early from leaving while others
still talk.
"""

import os

import torch

import chorus as dist  # torch: import torch.distributed as dist
import chorus as mp  # torch: import torch.multiprocessing as mp

MASTER_PORT = os.environ.get("MASTER_PORT", "12801")  # the seed's port, unless a test picks one


def run(rank, master_addr, master_port, world_size, backend="gloo"):
    """rank 0 --isend x10--> rank 2: keep every request, wait for all of them at the end."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://" + master_addr + ":" + master_port,
                            rank=rank, world_size=world_size)

    tensor = torch.zeros(1)
    buffer = []

    if rank == 0:  # sender: post all ten sends without waiting
        for i in range(10):
            tensor = torch.ones(1) * i
            req = dist.isend(tensor=tensor, dst=2)
            buffer.append(req)
    elif rank == 2:  # receiver: one irecv at a time, each waited for
        for _ in range(10):
            tmp_tensor = torch.zeros(1)
            req = dist.irecv(tensor=tmp_tensor, src=0)
            req.wait()
            tensor += tmp_tensor

    if rank == 0:
        for req in buffer:
            req.wait()  # every send has completed

    dist.barrier()  # nobody leaves while another rank still communicates
    print("Rank", rank, "has data", tensor[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
