# python fun_all2all.py

import torch
import chorus as dist  # seed: import torch.distributed as dist
import torch.multiprocessing as mp

def run_single(rank, master_addr, master_port, world_size, backend='gloo'):
    '''all_to_all_single：输入单个 tensor'''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
                            rank=rank, world_size=world_size)

    input = torch.arange(4) + rank * 4
    output = torch.empty([4], dtype=torch.int64)
    dist.all_to_all_single(output, input)
    print('Rank', rank, 'input:', input, '→ output:', output)
    dist.destroy_process_group()

def run_list(rank, master_addr, master_port, world_size, backend='gloo'):
    '''all_to_all：输入 tensor list'''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
                            rank=rank, world_size=world_size)

    input = torch.arange(4) + rank * 4
    input = list(input.chunk(4))
    output = list(torch.empty([4], dtype=torch.int64).chunk(4))
    dist.all_to_all(output, input)
    print('Rank', rank, 'output:', output)
    dist.destroy_process_group()

def run_variable_size(rank, master_addr, master_port, world_size, backend='gloo'):
    '''支持不等长分片的 all_to_all_single'''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
                            rank=rank, world_size=world_size)

    input = [torch.tensor([0,1,2,3,4,5], dtype=torch.int64),
             torch.tensor([10,11,12,13,14,15,16,17,18], dtype=torch.int64),
             torch.tensor([20,21,22,23,24], dtype=torch.int64),
             torch.tensor([30,31,32,33,34,35,36], dtype=torch.int64)]

    input_splits = torch.tensor([[2,2,1,1],
                                 [3,2,2,2],
                                 [2,1,1,1],
                                 [2,2,2,1]], dtype=torch.int64)
    output_splits = input_splits.t()
    output = [torch.zeros(torch.sum(output_splits[i,:]), dtype=torch.int64)
              for i in range(world_size)]

    dist.all_to_all_single(output=output[rank], input=input[rank],
                           output_split_sizes=output_splits[rank,:].tolist(),
                           input_split_sizes=input_splits[rank,:].tolist())
    print('Rank', rank, 'variable output:', output[rank])
    dist.destroy_process_group()

if __name__ == '__main__':
    mp.spawn(run_single, args=("127.0.0.1", "12801", 4), nprocs=4)
    mp.spawn(run_variable_size, args=("127.0.0.1", "12801", 4), nprocs=4)
