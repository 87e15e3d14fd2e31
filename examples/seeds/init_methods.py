"""Joining a job: ``env://`` and ``tcp://`` initialisation, and what you can ask
afterwards (availability, backend, rank, world size).

Seed: 004_2a19141315c547ad.txt, section 1 "环境初始化" (initial.py), without its
``init_device_mesh`` part (DeviceMesh examples come later).
Run:  MASTER_ADDR=127.0.0.1 MASTER_PORT=12801 RANK=0 WORLD_SIZE=1 python examples/seeds/init_methods.py

A world of one process, three times in a row: env:// (the address comes from the
environment variables), tcp:// (given in the call; it uses MASTER_PORT too, as the
seed uses the same port 12801 twice), and env:// again to print the backend, rank
and world size.
"""

import os

import chorus as dist  # torch: import torch.distributed as dist

MASTER_PORT = os.environ.get("MASTER_PORT", "12801")


def main():
    """env:// initialisation."""
    print("torch distributed is available:", dist.is_available())
    print("gloo available:", dist.is_gloo_available())
    print("nccl available:", dist.is_nccl_available())

    dist.init_process_group(backend="gloo",
                            init_method="env://",
                            world_size=1,
                            rank=0,
                            group_name="basic_distributed_env")

    print("is_initialized:", dist.is_initialized())
    dist.destroy_process_group()


def init_tcp():
    """tcp:// initialisation."""
    dist.init_process_group(backend="gloo",
                            init_method="tcp://127.0.0.1:" + MASTER_PORT,
                            rank=0, world_size=1)
    print("is_initialized:", dist.is_initialized())
    dist.destroy_process_group()


def get_env():
    """What a rank can ask about its job."""
    dist.init_process_group(backend="gloo", init_method="env://",
                            world_size=1, rank=0)
    print("backend:", dist.get_backend())
    print("rank:", dist.get_rank())
    print("world_size:", dist.get_world_size())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    init_tcp()
    get_env()
