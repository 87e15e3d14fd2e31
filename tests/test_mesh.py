"""chorus.DeviceMesh / chorus.init_device_mesh: groups, names, slicing, coordinates — and
the same group assignment as torch's DeviceMesh for the same shape."""

import numpy as np
import pytest

import chorus
from chorus.mesh import DeviceMesh, MeshDimError, dim_groups
from chorus.testing import run_threads

SHAPES = [(1,), (4,), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (2, 2, 2), (2, 1, 3), (3, 2)]


def test_dim_groups_are_the_lines_of_each_dimension():
    grid = np.arange(8).reshape(2, 2, 2)
    assert dim_groups(grid, 0) == [[0, 4], [2, 6], [1, 5], [3, 7]]  # axis 0 swapped with the last: torch's order
    assert dim_groups(grid, 1) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert dim_groups(grid, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def _mesh_2x2(rank, world):
    mesh = chorus.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    sums = {}
    for dim in ("dp", "tp"):
        t = np.array([rank], np.int64)
        chorus.all_reduce(t, group=mesh.get_group(dim))
        sums[dim] = int(t[0])
    dp, both = mesh["dp"], mesh["dp", "tp"]
    return {
        "coordinate": mesh.get_coordinate(), "sums": sums,
        "groups": [list(g.members) for g in mesh.get_all_groups()],
        "local": [mesh.get_local_rank("dp"), mesh.get_local_rank(1)],
        "dp_mesh": dp.mesh.tolist(), "dp_names": dp.mesh_dim_names, "dp_group_is_parents": dp.get_group() is mesh.get_group("dp"),
        "dp_local": dp.get_local_rank(), "both_is_mesh": both is mesh,
        "size": (mesh.size(), mesh.size("tp"), mesh.ndim, mesh.shape), "rank": mesh.get_rank(),
    }


def test_2x2_mesh_groups_slices_and_coordinates():
    results = run_threads(_mesh_2x2, 4)
    for rank, r in enumerate(results):
        row, col = divmod(rank, 2)
        assert r["coordinate"] == [row, col]
        assert r["groups"] == [[col, col + 2], [2 * row, 2 * row + 1]]
        assert r["sums"] == {"dp": 2 * col + 2, "tp": 4 * row + 1}
        assert r["local"] == [row, col]
        assert r["dp_mesh"] == [col, col + 2] and r["dp_names"] == ("dp",) and r["dp_group_is_parents"]
        assert r["dp_local"] == row and r["both_is_mesh"]
        assert r["size"] == (4, 2, 2, (2, 2)) and r["rank"] == rank


def _mesh_3d(rank, world):
    mesh = chorus.init_device_mesh("cpu", (2, 2, 2), ("pp", "dp", "tp"))
    sub = mesh["dp", "tp"]
    flat = chorus.init_device_mesh("cpu", (8,))
    return {"sub": sub.mesh.tolist(), "sub_groups": [list(g.members) for g in sub.get_all_groups()],
            "coordinate": mesh.get_coordinate(), "flat_is_world": flat.get_group() is chorus.group.WORLD,
            "repr": repr(sub)}


def test_3d_mesh_slicing_shares_the_parents_groups():
    results = run_threads(_mesh_3d, 8)
    r5 = results[5]
    assert r5["coordinate"] == [1, 0, 1]
    assert r5["sub"] == [[4, 5], [6, 7]]
    assert r5["sub_groups"] == [[5, 7], [4, 5]]
    assert r5["flat_is_world"]
    assert r5["repr"] == "DeviceMesh('cpu', [[4, 5], [6, 7]], mesh_dim_names=('dp', 'tp'))"


def _mesh_errors(rank, world):
    mesh = chorus.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    errors = {}
    for name, call in {"order": lambda: mesh["tp", "dp"], "unknown": lambda: mesh["pp"],
                       "no_dim": lambda: mesh.get_group(), "bad_index": lambda: mesh.get_group(2),
                       "shape": lambda: chorus.init_device_mesh("cpu", (3,)),
                       "names": lambda: chorus.init_device_mesh("cpu", (2, 2), ("dp", "dp")),
                       "device": lambda: chorus.init_device_mesh("tpu", (4,)),
                       "dup_ranks": lambda: DeviceMesh("cpu", [[0, 0], [1, 2]])}.items():
        try:
            call()
        except chorus.ChorusError as exc:
            errors[name] = (type(exc).__name__, isinstance(exc, KeyError), str(exc))
    return errors


def test_mesh_errors_say_what_is_wrong():
    errors = run_threads(_mesh_errors, 4)[0]
    assert set(errors) == {"order", "unknown", "no_dim", "bad_index", "shape", "names", "device", "dup_ranks"}
    assert errors["order"][1] and errors["unknown"][1]  # KeyError, as torch raises
    assert "mesh's order" in errors["order"][2] and "'pp'" in errors["unknown"][2]
    assert "pass mesh_dim" in errors["no_dim"][2]
    assert "world has 4" in errors["shape"][2]
    assert "use \"cpu\" or \"cuda\"" in errors["device"][2]


@pytest.mark.parametrize("shape", SHAPES)
def test_same_groups_as_torch_device_mesh(shape):
    """torch's DeviceMesh on its fake process group (any rank, no processes) vs chorus's."""
    torch = pytest.importorskip("torch", reason="comparing with torch's DeviceMesh needs torch")
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = int(np.prod(shape))
    grid = np.arange(world).reshape(shape)
    for rank in range(world):
        tdist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", shape)
            theirs = [tdist.get_process_group_ranks(mesh.get_group(d)) for d in range(len(shape))]
            coordinate = list(mesh.get_coordinate())
            local = [mesh.get_local_rank(d) for d in range(len(shape))]
        finally:
            tdist.destroy_process_group()
        mine = [next(g for g in dim_groups(grid, d) if rank in g) for d in range(len(shape))]
        assert theirs == [sorted(g) for g in mine], (shape, rank)
        assert coordinate == [int(c) for c in np.argwhere(grid == rank)[0]]
        assert local == [sorted(g).index(rank) for g in mine]
    del torch


def _against_torch_threads(rank, world, shape):
    mesh = chorus.init_device_mesh("cpu", shape)
    return [list(g.members) for g in mesh.get_all_groups()], mesh.get_coordinate(), \
        [mesh.get_local_rank(d) for d in range(len(shape))]


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4), (4, 2)])
def test_native_mesh_builds_the_groups_dim_groups_describes(shape):
    world = int(np.prod(shape))
    grid = np.arange(world).reshape(shape)
    for rank, (groups, coordinate, local) in enumerate(run_threads(_against_torch_threads, world, shape)):
        mine = [sorted(next(g for g in dim_groups(grid, d) if rank in g)) for d in range(len(shape))]
        assert groups == mine
        assert coordinate == [int(c) for c in np.argwhere(grid == rank)[0]]
        assert local == [g.index(rank) for g in mine]


def test_mesh_errors_are_key_errors_too():
    assert issubclass(MeshDimError, KeyError) and issubclass(MeshDimError, chorus.ChorusError)
