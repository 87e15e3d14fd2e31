"""The seeds' DDP example, made to train: an MLP on synthetic data, DistributedDataParallel
on chorus's torch backend, the mean loss printed every step.

    python -m chorus.run --nproc-per-node 4 examples/ddp_train.py       # chorusrun
    torchrun --nproc-per-node 4 examples/ddp_train.py                   # torchrun
    torchrun --nproc-per-node 4 examples/ddp_train.py --backend gloo    # the same on gloo

Every rank draws its own samples of one regression problem (y = x . w + noise); DDP
averages the gradients, so the loss falls the same way on every backend.  Rank 0 also
prints the mean time of a training step (after two warm-up steps); a ~25M-parameter
model for comparing backends: ``--features 2048 --hidden 4096``.
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import chorus.torch  # noqa: F401 - registers backend "chorus" (and env:// under chorusrun)


def train_model(backend: str, steps: int, features: int, hidden: int, batch: int) -> None:
    dist.init_process_group(backend=backend)  # env:// — set by chorusrun / torchrun
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same initial model everywhere (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 1))
    ddp_model = DDP(model)
    criterion = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.05)
    if rank == 0:
        print(f"{backend}: {world_size} ranks, {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)

    w_true = torch.linspace(-1, 1, features).unsqueeze(1) / features ** 0.5
    samples = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    step_times = []
    for step in range(steps):
        inputs = torch.randn(batch, features, generator=samples)
        labels = inputs @ w_true + 0.01 * torch.randn(batch, 1, generator=samples)
        start = time.perf_counter()

        outputs = ddp_model(inputs)
        loss = criterion(outputs, labels)
        optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients here
        optimizer.step()
        step_times.append(time.perf_counter() - start)

        mean = loss.detach().clone()
        dist.all_reduce(mean)  # SUM (gloo has no AVG)
        if rank == 0:
            print(f"step {step:3d}  loss {mean.item() / world_size:.6f}", flush=True)

    print(f"Rank {rank}, final local loss: {loss.item():.6f}", flush=True)
    if rank == 0 and steps > 2:
        timed = step_times[2:]
        print(f"mean step time {1e3 * sum(timed) / len(timed):.1f} ms over {len(timed)} steps ({backend})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="chorus", help="chorus (default) or gloo")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--features", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    train_model(args.backend, args.steps, args.features, args.hidden, args.batch)
