# python fun_gather.py

import torch
import chorus as dist  # seed: import torch.distributed as dist
import torch.multiprocessing as mp
import time

def run(rank, master_addr, master_port, world_size, backend='gloo'):
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
                            rank=rank, world_size=world_size)

    # all_gather → list of tensors
    tensor_list = [torch.zeros(2, dtype=torch.int64) for _ in range(world_size)]
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    dist.all_gather(tensor_list=tensor_list, tensor=tensor)
    print('Rank', rank, 'all_gather:', tensor_list)

    # all_gather_into_tensor → 单个大 tensor
    tensor_trg = torch.zeros(2 * world_size, dtype=torch.int64)
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    dist.all_gather_into_tensor(output_tensor=tensor_trg, input_tensor=tensor)
    print('Rank', rank, 'all_gather_into_tensor:', tensor_trg)

    time.sleep(1)

    # all_gather_object → 任意 picklable 对象
    gather_objects = ["foo", 12, {1: 2}, 'xiaodongguaAIGC']
    output = [None for _ in gather_objects]
    dist.all_gather_object(output, gather_objects[rank])
    print(f'rank:{rank}', output)

    dist.destroy_process_group()


def p2p_gather(rank, master_addr, master_port, world_size, backend='gloo'):
    '''手撕 all_gather_into_tensor'''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
                            rank=rank, world_size=world_size)
    group = dist.new_group(ranks=[0, 1, 2, 3])

    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    tensor_trg = torch.arange(2 * world_size)
    tensor_list = [torch.arange(2, dtype=torch.int64) for _ in range(world_size)]

    # Step 1: rank 0 收集各 rank 数据
    if rank == 0:
        tensor_list[0] = tensor
        ranks = dist.get_process_group_ranks(group)
        for r in ranks:
            if r != 0:
                dist.recv(tensor_list[r], src=r)
    else:
        dist.send(tensor, dst=0)

    # Step 2: rank 0 合并
    if rank == 0:
        tensor_trg = torch.concat(tensor_list, dim=0)

    # Step 3: broadcast 完整结果
    dist.broadcast(tensor_trg, src=0)
    print(f'rank:{rank} all-gather result', tensor_trg)

    dist.destroy_process_group()

if __name__ == '__main__':
    mp.spawn(run, args=("127.0.0.1", "12801", 4), nprocs=4)
    mp.spawn(p2p_gather, args=("127.0.0.1", "12801", 4), nprocs=4)
