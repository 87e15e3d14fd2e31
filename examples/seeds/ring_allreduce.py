# python fun_ring_allreduce.py

import torch
import chorus as dist  # seed: import torch.distributed as dist
import torch.multiprocessing as mp

def run(rank, master_addr, master_port, world_size, backend='gloo'):
    '''
    Ring AllReduce = ReduceScatter + AllGather
    注意：偶数 rank 先 send 再 recv，防止死锁
    '''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
                            rank=rank, world_size=world_size)

    batch = torch.zeros(2 * world_size, dtype=torch.int64) + 1
    micro_batch = list(torch.split(batch, 2, dim=0))
    tmp_tensor = torch.zeros(2, dtype=torch.int64)

    # ======== Stage 1: ReduceScatter ========
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
        print('Stage 1 (ReduceScatter) complete')
    print('Rank', rank, 'after ReduceScatter:', micro_batch)
    dist.barrier()

    # ======== Stage 2: AllGather ========
    for i in range(world_size - 1):
        cur_idx = (i + rank + 1) % world_size
        next_idx = (cur_idx + 1) % world_size
        if rank % world_size == 0:
            dist.send(micro_batch[cur_idx], dst=(rank + 1) % world_size)
            dist.recv(tmp_tensor, src=(rank - 1) % world_size)
        else:
            dist.recv(tmp_tensor, src=(rank - 1) % world_size)
            dist.send(micro_batch[cur_idx], dst=(rank + 1) % world_size)
        micro_batch[next_idx] = tmp_tensor

    dist.barrier()
    if rank == 0:
        print('Stage 2 (AllGather) complete')
    print('Rank', rank, 'after AllGather:', micro_batch)
    dist.barrier()

    dist.destroy_process_group()

if __name__ == '__main__':
    mp.spawn(run, args=("127.0.0.1", "12801", 4), nprocs=4)
