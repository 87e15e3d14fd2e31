"""FSDP2 (``fully_shard``) on chorus's torch backend: every rank keeps a 1/W shard of each
layer's parameters; forward all-gathers them, backward reduce-scatters the gradients.

    python -m chorus.run --nproc-per-node 4 examples/fsdp_train.py      # chorusrun
    torchrun --nproc-per-node 4 examples/fsdp_train.py                  # torchrun

Prints the mean loss per step and, at the end, each rank's share of the parameters.
(On gloo, FSDP2 needs ``model.set_force_sum_reduction_for_comms(True)``: gloo has no
AVG reduction; chorus has.)
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import chorus.torch  # noqa: F401 - registers backend "chorus" (and env:// under chorusrun)


def main(steps: int) -> None:
    dist.init_process_group("chorus")
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)  # one all-gather / reduce-scatter per layer
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    samples = torch.Generator().manual_seed(1000 + rank)
    for step in range(steps):
        x = torch.randn(64, 32, generator=samples)
        y = torch.tanh(x @ w_true)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step:3d}  loss {mean.item():.6f}", flush=True)

    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    print(f"Rank {rank} holds {local} of {total} parameters", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    main(parser.parse_args().steps)
