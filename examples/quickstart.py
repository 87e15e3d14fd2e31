"""chorus quick start: run with  python3 -m chorus.run --nproc-per-node 4 examples/quickstart.py

Each rank joins the job, passes a token around a ring with send/recv, exchanges arrays
with its neighbours asynchronously, meets the others at a barrier and leaves.
"""

import numpy as np

import chorus as dist


def main() -> None:
    dist.init_process_group("chorus")  # env:// — chorusrun (or torchrun) set the variables
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank} of {world} is up")

    # 1. A token travels once around the ring 0 -> 1 -> ... -> 0; each rank adds its rank.
    token = np.zeros(1, dtype=np.int64)
    if rank == 0:
        dist.send(token, dst=1 % world)
        dist.recv(token, src=world - 1)
        print(f"token came back to rank 0 holding {token[0]} (= 0 + 1 + ... + {world - 1})")
    else:
        dist.recv(token, src=rank - 1)
        token += rank
        dist.send(token, dst=(rank + 1) % world)

    # 2. Asynchronous exchange with both neighbours at once.
    mine = np.full(4, float(rank))
    from_left, from_right = np.empty(4), np.empty(4)
    left, right = (rank - 1) % world, (rank + 1) % world
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, mine, right), dist.P2POp(dist.irecv, from_left, left),
        dist.P2POp(dist.isend, mine, left), dist.P2POp(dist.irecv, from_right, right),
    ])
    for work in works:
        work.wait()
    print(f"rank {rank}: left neighbour sent {from_left[0]:.0f}, right neighbour sent {from_right[0]:.0f}")

    # 3. Everyone waits here until all ranks arrived.
    dist.barrier()
    if rank == 0:
        print("all ranks passed the barrier")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
