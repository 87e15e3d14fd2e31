"""Ring all-reduce written with send/recv: a reduce-scatter pass and an all-gather pass
around the ring 0 -> 1 -> 2 -> 3 -> 0.

Seed: 004_2a19141315c547ad.txt, section 8 "Ring-AllReduce 环形全规约"
(fun_ring_allreduce.py).
Run:  python examples/seeds/ring_allreduce.py  (4 processes, started like mp.spawn)

Each rank cuts its data (all ones, 2 per rank) into world_size chunks.

    reduce-scatter: in round i rank r sends chunk (r - i) to its right neighbour and
                    adds what its left neighbour sent into chunk (r - i - 1); after
                    world_size - 1 rounds rank r owns the full sum of chunk (r + 1).
    all-gather:     the finished chunks travel once more around the ring, copied
                    instead of added; afterwards every chunk is [4, 4] on every rank.

Every rank sends 2 (N - 1) / N of its data in total, whatever N is.  Blocking sends on
a ring would deadlock if everybody sent first, so rank 0 sends first and the others
receive first.
"""

import os

import torch

import chorus as dist  # torch: import torch.distributed as dist
import chorus as mp  # torch: import torch.multiprocessing as mp

MASTER_PORT = os.environ.get("MASTER_PORT", "12801")  # the seed's port, unless a test picks one


def run(rank, master_addr, master_port, world_size, backend="gloo"):
    """Ring all-reduce = reduce-scatter + all-gather."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + master_port,
                            rank=rank, world_size=world_size)

    batch = torch.zeros(2 * world_size, dtype=torch.int64) + 1
    micro_batch = list(torch.split(batch, 2, dim=0))
    tmp_tensor = torch.zeros(2, dtype=torch.int64)

    # ======== stage 1: reduce-scatter ========
    for i in range(world_size - 1):
        cur_idx = (rank - i) % world_size
        next_idx = (rank - i - 1) % world_size
        if rank % world_size == 0:
            dist.send(micro_batch[cur_idx], dst=(rank + 1) % world_size)
            dist.recv(tmp_tensor, src=(rank - 1) % world_size)
        else:
            dist.recv(tmp_tensor, src=(rank - 1) % world_size)
            dist.send(micro_batch[cur_idx], dst=(rank + 1) % world_size)
        micro_batch[next_idx] += tmp_tensor

    dist.barrier()
    if rank == 0:
        print("Stage 1 (ReduceScatter) complete")
    print("Rank", rank, "after ReduceScatter:", micro_batch)
    dist.barrier()

    # ======== stage 2: all-gather ========
    for i in range(world_size - 1):
        cur_idx = (i + rank + 1) % world_size
        next_idx = (cur_idx + 1) % world_size
        if rank % world_size == 0:
            dist.send(micro_batch[cur_idx], dst=(rank + 1) % world_size)
            dist.recv(tmp_tensor, src=(rank - 1) % world_size)
        else:
            dist.recv(tmp_tensor, src=(rank - 1) % world_size)
            dist.send(micro_batch[cur_idx], dst=(rank + 1) % world_size)
        # The seed stores tmp_tensor itself here, so every received chunk would be the
        # same tensor, overwritten by the next recv; a copy keeps each chunk (the
        # printed values are the same either way, because all chunks end up equal).
        micro_batch[next_idx] = tmp_tensor.clone()

    dist.barrier()
    if rank == 0:
        print("Stage 2 (AllGather) complete")
    print("Rank", rank, "after AllGather:", micro_batch)
    dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=("127.0.0.1", MASTER_PORT, 4), nprocs=4)
