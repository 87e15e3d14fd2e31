# python fun_reduce.py

import torch
import chorus as dist  # seed: import torch.distributed as dist
import torch.multiprocessing as mp
import time

def run(rank, master_addr, master_port, world_size, backend='gloo'):
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
                            rank=rank, world_size=world_size)

    # all_reduce SUM：所有 rank 结果一致
    tensor = torch.ones(1) * 2 * rank
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    print('Rank', rank, 'all_reduce SUM:', tensor)

    # all_reduce MAX
    tensor = torch.ones(1) * 2 * rank
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    print('Rank', rank, 'all_reduce MAX:', tensor)

    time.sleep(1)

    # reduce：结果仅在 dst=0
    tensor = torch.ones(1) * 2 * rank
    dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
    print('Rank', rank, 'reduce to rank 0:', tensor)

    dist.destroy_process_group()


def p2p_reduce(rank, master_addr, master_port, world_size, backend='gloo'):
    '''
    手撕 all_reduce：
    1. rank 0 作为参数服务器，收集其他 GPU 数据
    2. 在 rank 0 上计算 SUM
    3. broadcast 结果给所有 rank
    '''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
                            rank=rank, world_size=world_size)
    group = dist.new_group(ranks=[0, 1, 2, 3])

    tensor = torch.ones(2) * rank * 2
    tensor_sum = torch.ones(2) * rank * 2
    time.sleep(1)

    # Step 1: rank 0 收集并求和
    if dist.get_rank() == 0:
        ranks = dist.get_process_group_ranks(group)
        tmp = torch.zeros(2)
        for r in ranks:
            if r != 0:
                dist.recv(tensor=tmp, src=r)
                tensor_sum += tmp
    elif rank != 0:
        dist.send(tensor=tensor, dst=0)

    # Step 2: 广播结果
    dist.broadcast(tensor_sum, src=0)
    print('Rank', rank, 'has data', tensor_sum)
    dist.destroy_process_group()

if __name__ == '__main__':
    mp.spawn(run, args=("127.0.0.1", "12801", 4), nprocs=4)
    mp.spawn(p2p_reduce, args=("127.0.0.1", "12801", 4), nprocs=4)
