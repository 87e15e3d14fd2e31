# python p2p.py

import torch
import chorus as dist  # seed: import torch.distributed as dist
import torch.multiprocessing as mp

def run(rank, master_addr, master_port, world_size, backend='gloo'):
    '''同步 P2P 通信：rank 0 → rank 1'''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:' + master_port,
                            rank=rank, world_size=world_size)

    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        dist.send(tensor=tensor, dst=1)  # 阻塞发送
        tensor -= 1
    elif rank == 1:
        dist.recv(tensor=tensor, src=0)  # 阻塞接收

    print('Rank', rank, 'has data', tensor[0])
    dist.destroy_process_group()

if __name__ == '__main__':
    mp.spawn(run, args=("127.0.0.1", "12801", 4), nprocs=4)
