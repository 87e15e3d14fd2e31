"""chorus quick start: run with  python3 -m chorus.run --nproc-per-node 4 examples/quickstart.py

Each rank joins the job, passes a token around a ring with send/recv, exchanges arrays
with its neighbours asynchronously, runs the main collectives (one of them
asynchronously), meets the others at a barrier and leaves.
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

    # 3. Collectives: every rank gets the sum, everyone's rank, and rank 0's array.
    total = np.array([float(rank)])
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    ranks = [np.zeros(1, dtype=np.int64) for _ in range(world)]
    dist.all_gather(ranks, np.array([rank]))
    config = np.array([0.1, 32.0]) if rank == 0 else np.zeros(2)
    dist.broadcast(config, src=0)
    print(f"rank {rank}: sum of ranks = {total[0]:.0f}, gathered {[int(r[0]) for r in ranks]}, "
          f"rank 0's config = {config.tolist()}")

    # 4. An asynchronous all_reduce overlaps with local work; wait() before reading it.
    grads = np.full(1000, float(rank + 1), dtype=np.float32)
    work = dist.all_reduce(grads, op=dist.ReduceOp.AVG, async_op=True)
    local = float(np.sum(np.arange(1000)))  # ... useful work while the data moves ...
    work.wait()
    if rank == 0:
        print(f"averaged gradient = {grads[0]} (local work meanwhile gave {local:.0f})")

    # 5. Everyone waits here until all ranks arrived.
    dist.barrier()
    if rank == 0:
        print("all ranks passed the barrier")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
