# python fun_reduce_scatter.py

import torch
import chorus as dist  # seed: import torch.distributed as dist
import torch.multiprocessing as mp
import time

def run(rank, master_addr, master_port, world_size, backend='gloo'):
    '''
    reduce_scatter 适用于 ZeRO-2：
    收集所有梯度 → reduce → 切分 → 各 GPU 维护部分梯度/优化器参数
    '''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
                            rank=rank, world_size=world_size)

    # 基础 reduce_scatter
    tensor_out = torch.zeros(2, dtype=torch.int64)
    tensor_in = torch.arange(world_size * 2, dtype=torch.int64)
    dist.reduce_scatter_tensor(tensor_out, tensor_in, op=dist.ReduceOp.SUM)
    print('Rank', rank, 'reduce_scatter:', tensor_out)

    time.sleep(1)

    # stack 形式
    tensor_in = torch.reshape(
        torch.arange(world_size * 2, dtype=torch.int64), (world_size, 2))
    tensor_out = torch.zeros(1, 2, dtype=torch.int64)
    dist.reduce_scatter_tensor(tensor_out, tensor_in)
    print('Rank', rank, 'reduce_scatter (stack):', tensor_out)

    dist.destroy_process_group()


def p2p_reduce_scatter(rank, master_addr, master_port, world_size, backend='gloo'):
    '''手撕 reduce_scatter：先 reduce 到 rank 0，再 scatter 各分片'''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
                            rank=rank, world_size=world_size)
    group = dist.new_group(ranks=[0, 1, 2, 3])

    tensor_out = torch.zeros(2, dtype=torch.int64)
    tensor_in = torch.arange(world_size * 2, dtype=torch.int64)
    tensor_reduce = torch.arange(world_size * 2, dtype=torch.int64)

    # Step 1: rank 0 收集并 reduce
    if rank == 0:
        tensor_tmp = torch.zeros(world_size * 2, dtype=torch.int64)
        for r in dist.get_process_group_ranks(group):
            if r != 0:
                dist.recv(tensor_tmp, src=r)
                tensor_reduce += tensor_tmp
    else:
        dist.send(tensor_in, dst=0)

    time.sleep(1)

    # Step 2: rank 0 切分并 scatter
    if rank == 0:
        scatter_list = list(tensor_reduce.split(split_size=2, dim=0))
        for r in dist.get_process_group_ranks(group):
            if r != 0:
                dist.send(scatter_list[r], dst=r)
            else:
                tensor_out = scatter_list[0]
    else:
        dist.recv(tensor_out, src=0)

    print('Rank', rank, 'p2p reduce_scatter:', tensor_out)
    dist.destroy_process_group()

if __name__ == '__main__':
    mp.spawn(run, args=("127.0.0.1", "12801", 4), nprocs=4)
    mp.spawn(p2p_reduce_scatter, args=("127.0.0.1", "12801", 4), nprocs=4)
