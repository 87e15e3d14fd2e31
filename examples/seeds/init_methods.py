# MASTER_ADDR=127.0.0.1 MASTER_PORT=12801 RANK=0 WORLD_SIZE=1 python initial.py

import torch
import chorus as dist  # seed: import torch.distributed as dist

def main():
    '''环境变量方式初始化'''
    print('torch distributed is available:', dist.is_available())
    print('gloo available:', dist.is_gloo_available())
    print('nccl available:', dist.is_nccl_available())

    dist.init_process_group(backend="gloo",
                            init_method='env://',
                            world_size=1,
                            rank=0,
                            group_name='basic_distributed_env')

    print('is_initialized:', dist.is_initialized())
    dist.destroy_process_group()

def init_tcp():
    '''TCP 方式初始化'''
    dist.init_process_group(backend='gloo',
                            init_method='tcp://127.0.0.1:12801',
                            rank=0, world_size=1)
    print('is_initialized:', dist.is_initialized())
    dist.destroy_process_group()

def init_device_mesh():
    '''DeviceMesh 方式 — 支持 2D 拓扑'''
    # 1D mesh
    dist.init_device_mesh(device_type='cpu', mesh_shape=(1,1))
    dist.destroy_process_group()

    # 2D mesh（DP × TP）
    dist.init_device_mesh(device_type='cpu',
                          mesh_shape=(1,1),
                          mesh_dim_names=("dp", "tp"))
    dist.destroy_process_group()

def get_env():
    '''查看分布式环境信息'''
    dist.init_process_group(backend="gloo", init_method='env://',
                            world_size=1, rank=0)
    print('backend:', dist.get_backend())
    print('rank:', dist.get_rank())
    print('world_size:', dist.get_world_size())
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
    init_tcp()
    get_env()
    init_device_mesh()
