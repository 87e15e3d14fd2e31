"""A DDP training run on GPUs (one process per GPU) with a given torch.distributed backend:
writes each step's loss and a checksum of the final parameters of every rank."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as tdist


def train(rank: int, world: int, backend: str, port: int, steps: int, out: str) -> None:
    # (CHORUS_CUDA_NCCL_FROM_BYTES: the hand-off from 8 MiB, so that the 8 MiB bucket below goes to NCCL)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      NCCL_NVLS_ENABLE="0", CHORUS_CUDA_NCCL_FROM_BYTES=str(8 << 20))
    if backend == "chorus":
        import chorus.torch  # noqa: F401  (registers backend "chorus")
    torch.cuda.set_device(rank)
    tdist.init_process_group(backend)
    torch.manual_seed(0)
    # (the middle weight, 8 MiB, is a bucket of its own that chorus hands to NCCL)
    model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
    natives: list[int] = []
    if backend == "chorus":  # count the async all_reduces the lane handed to NCCL
        from chorus.cuda.component import CudaComponent

        lane = CudaComponent.all_reduce_now

        def counting(self, tensor, op, async_op=False):
            done = lane(self, tensor, op, async_op)
            if getattr(done, "native", None) is not None:
                natives.append(tensor.numel())
            return done

        CudaComponent.all_reduce_now = counting
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank], bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 256, generator=gen).cuda()
        y = torch.randint(0, 10, (64,), generator=gen).cuda()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        tdist.all_reduce(avg)
        losses.append(avg.item() / world)
    record = {}
    if backend == "chorus":  # a CUDA op's future is ProcessGroupNCCL's kind: done at enqueue
        record["lane_handoffs_in_ddp"] = len(natives)
        t = torch.full((4,), float(rank + 1), device="cuda")
        future = tdist.all_reduce(t, async_op=True).get_future()
        record["future_done_at_once"] = future.done()
        record["future_value"] = future.wait()[0].tolist()
        # NCCL's size (16 MiB): issued async, the caller's stream does not wait for it, yet the
        # group's ops run in issue order: the same tensor twice, or NCCL's op and then
        # chorus's kernels on part of it, give what one op after the other gives
        big = torch.ones(4 << 20, device="cuda")
        tdist.all_reduce(big)  # (synchronous, on the lane: the caller's stream waits)
        big.fill_(1.0)
        first = tdist.all_reduce(big, async_op=True)
        second = tdist.all_reduce(big, async_op=True)
        future = second.get_future()
        second.wait()
        first.wait()
        record["handoff_twice"] = [big[0].item(), big[-1].item()]
        record["handoff_future_is_the_tensor"] = future.wait()[0].data_ptr() == big.data_ptr()
        record["handoffs_async_on_the_lane"] = len(natives) - record["lane_handoffs_in_ddp"]
        big.fill_(1.0)
        work = tdist.all_reduce(big, async_op=True)
        tdist.all_reduce(big[:1024])
        work.wait()
        record["handoff_then_kernels"] = [big[0].item(), big[-1].item()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    sums = [torch.zeros(2, dtype=torch.float64, device="cuda") for _ in range(world)]
    tdist.all_gather(sums, torch.stack([flat.double().sum(), (flat.double() ** 2).sum()]))
    with open(os.path.join(out, f"{backend}-rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "checksums": [s.tolist() for s in sums], **record}, f)
    tdist.destroy_process_group()
