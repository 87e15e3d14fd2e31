# python p2p_async.py

import torch
import chorus as dist  # seed: import torch.distributed as dist
import torch.multiprocessing as mp

def run(rank, master_addr, master_port, world_size, backend='gloo'):
    '''
    异步通信：rank 0 连续发送 10 个数据给 rank 2
    发送方不必等待接收方完成，通过 buffer 收集所有 request 最后统一 wait
    '''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://' + master_addr + ':' + master_port,
                            rank=rank, world_size=world_size)

    tensor = torch.zeros(1)
    buffer = []

    if rank == 0:   # 发送方：连续异步发送
        for i in range(10):
            tensor = torch.ones(1) * i
            req = dist.isend(tensor=tensor, dst=2)
            buffer.append(req)
    elif rank == 2: # 接收方：逐个异步接收
        for i in range(10):
            tmp_tensor = torch.zeros(1)
            req = dist.irecv(tensor=tmp_tensor, src=0)
            req.wait()  # 等待单个接收完成
            tensor += tmp_tensor

    if rank == 0:
        for req in buffer:
            req.wait()  # 确保所有发送完成

    dist.barrier()  # 防止先完成的 rank destroy 导致其他 rank hang
    print('Rank', rank, 'has data', tensor[0])
    dist.destroy_process_group()

if __name__ == '__main__':
    mp.spawn(run, args=("127.0.0.1", "12801", 4), nprocs=4)
