# python fun_broadcast.py

import torch
import chorus as dist  # seed: import torch.distributed as dist
import torch.multiprocessing as mp
import time

def run(rank, master_addr, master_port, world_size, backend='gloo'):
    '''API 版 broadcast'''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
                            rank=rank, world_size=world_size)

    # 广播 object list
    if dist.get_rank() == 0:
        objects = ["foo", 12, {1: 2}]
    else:
        objects = [None, None, None]
    dist.broadcast_object_list(objects, src=0)
    print('Rank', rank, 'has data', objects)

    time.sleep(1)

    # 广播 tensor
    tensor = torch.zeros(2)
    if dist.get_rank() == 0:
        tensor = tensor + 100
    dist.broadcast(tensor, src=0)
    print('Rank', rank, 'has data', tensor)

    time.sleep(1)

    # 组内广播（子 group）
    tensor = torch.ones(2) * rank * 2
    group = dist.new_group(ranks=[0, 1])
    dist.broadcast(tensor, src=1, group=group)
    print('Rank', rank, 'has data', tensor)

    dist.destroy_process_group()


def p2p_broadcast(rank, master_addr, master_port, world_size, backend='gloo'):
    '''手撕 broadcast：rank 0 逐个 send 给其他 rank'''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
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

    print('Rank', rank, 'has data', tensor)
    dist.destroy_process_group()

if __name__ == '__main__':
    mp.spawn(run, args=("127.0.0.1", "12801", 4), nprocs=4)
    mp.spawn(p2p_broadcast, args=("127.0.0.1", "12801", 4), nprocs=4)
