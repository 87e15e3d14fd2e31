"""Checking the helpers: reduce_tensor, gather_tensor, broadcast_tensor on known values
-- and an asynchronous all-reduce overlapped with computation.

Seed: 003_c0b9def01b497aca.txt, section 7.3 "调试技巧" (debug_communication) and
section 7.2 "异步通信（高级）"; the helpers are the seed's ``distributed.py``, shipped as
``chorus.utils``.
Run:  python -m chorus.run --nproc-per-node=4 examples/seeds/helpers_debug.py
      python examples/seeds/helpers_debug.py        (not distributed: one process)

On 4 ranks:  Rank r: reduce test 6.0 == 6;  Gathered: [0.0, 1.0, 2.0, 3.0] (rank 0);
             Rank r: broadcast result tensor([1., 2., 3.]);
             Rank r: async all_reduce [10.0, 10.0, 10.0, 10.0] (1 + 2 + 3 + 4)
Alone:       the same code: reduce test 0.0 == 0, Gathered: [0.0], the broadcast keeps
             rank 0's data; the asynchronous part needs a job and is skipped.
"""

import logging
import os
import sys

import torch

import chorus as dist  # torch: import torch.distributed as dist
from chorus.utils import (
    broadcast_tensor,
    gather_tensor,
    get_device,
    get_rank,
    get_world_size,
    is_main_process,
    reduce_tensor,
)

logger = logging.getLogger("distributed")  # the seed's logger: messages to stdout
logger.addHandler(logging.StreamHandler(sys.stdout))
logger.setLevel(logging.INFO)


def debug_communication():
    rank = get_rank()

    # reduce: the sum of the ranks
    test_tensor = torch.tensor(rank, dtype=torch.float, device=get_device())
    reduced = reduce_tensor(test_tensor, op="sum")
    expected_sum = sum(range(get_world_size()))

    logger.info(f"Rank {rank}: reduce test {reduced.item()} == {expected_sum}")

    # gather: every rank's value on rank 0
    gathered = gather_tensor(test_tensor, dst=0)
    if is_main_process():
        logger.info(f"Gathered: {[t.item() for t in gathered]}")

    # broadcast: rank 0's data everywhere
    if rank == 0:
        broadcast_data = torch.tensor([1.0, 2.0, 3.0], device=get_device())
    else:
        broadcast_data = torch.zeros(3, device=get_device())

    broadcast_data = broadcast_tensor(broadcast_data, src=0)
    logger.info(f"Rank {rank}: broadcast result {broadcast_data}")


def other_computation():
    return sum(i * i for i in range(100_000))


def overlap_communication():
    """Start the all-reduce, compute while it runs, wait for it before using the result."""
    rank = get_rank()
    tensor = torch.ones(4) * (rank + 1)
    handle = dist.all_reduce(tensor, async_op=True)
    other_computation()  # runs while the all-reduce is under way
    handle.wait()
    logger.info(f"Rank {rank}: async all_reduce {tensor.tolist()}")


if __name__ == "__main__":
    distributed = "RANK" in os.environ  # set by chorusrun / torchrun
    if distributed:
        dist.init_process_group("gloo")
    debug_communication()
    if distributed:
        overlap_communication()
        dist.destroy_process_group()
