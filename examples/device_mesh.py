"""A 2-D DeviceMesh ("dp" x "tp") whose groups are chorus groups, and a DTensor moved
between shardings on it.

    python -m chorus.run --nproc-per-node 4 examples/device_mesh.py             # chorusrun
    torchrun --nproc-per-node 4 examples/device_mesh.py                         # torchrun
    python -m chorus.run --nproc-per-node 4 examples/device_mesh.py --native    # no torch.distributed

With 4 ranks the mesh is [[0, 1], [2, 3]]: "tp" groups are the rows [0, 1], [2, 3],
"dp" groups the columns [0, 2], [1, 3].  Each rank all-reduces its rank along each
dimension and prints the sums.  ``--native`` builds the same mesh with chorus's own
``chorus.init_device_mesh`` (numpy arrays, no torch; chorusrun or chorus.spawn only).
"""

import argparse


def with_torch() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import chorus.torch  # noqa: F401 - registers backend "chorus" (and env:// under chorusrun)

    dist.init_process_group("chorus")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    sums = {}
    for dim in ("dp", "tp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.get_group(dim))
        sums[dim] = (dist.get_process_group_ranks(mesh.get_group(dim)), t.item())
    print(f"rank {rank} at {list(mesh.get_coordinate())}: dp group {sums['dp'][0]} sum {sums['dp'][1]:g}, "
          f"tp group {sums['tp'][0]} sum {sums['tp'][1]:g} ({dist.get_backend(mesh.get_group('tp'))})", flush=True)

    full = torch.arange(8.0 * world).reshape(8, world)
    sharded = distribute_tensor(full, mesh, [Shard(0), Shard(1)])  # a block per rank
    replicated = sharded.redistribute(mesh, [Replicate(), Replicate()])
    if rank == 0:
        print(f"DTensor: local block {tuple(sharded.to_local().shape)} of {tuple(full.shape)}; "
              f"round trip exact: {torch.equal(replicated.to_local(), full)}", flush=True)
    dist.destroy_process_group()


def native() -> None:
    import numpy as np

    import chorus

    chorus.init_process_group()
    rank, world = chorus.get_rank(), chorus.get_world_size()
    mesh = chorus.init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    sums = {}
    for dim in ("dp", "tp"):
        t = np.array([float(rank)])
        chorus.all_reduce(t, group=mesh.get_group(dim))
        sums[dim] = (list(mesh.get_group(dim).members), t[0])
    print(f"rank {rank} at {mesh.get_coordinate()}: dp group {sums['dp'][0]} sum {sums['dp'][1]:g}, "
          f"tp group {sums['tp'][0]} sum {sums['tp'][1]:g}; mesh['tp'] = {mesh['tp'].mesh.tolist()}", flush=True)
    chorus.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--native", action="store_true", help="chorus.init_device_mesh, without torch")
    native() if parser.parse_args().native else with_torch()
