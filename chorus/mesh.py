"""``DeviceMesh`` and ``init_device_mesh``: an n-dimensional grid of ranks with one process
group per row of each dimension — torch's API, without torch.

    mesh = chorus.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    world of 4:            dp groups (dim 0)     tp groups (dim 1)
        tp ->                 [0, 2]               [0, 1]
    dp [[0, 1],               [1, 3]               [2, 3]
        [2, 3]]

    rank 3: mesh.get_coordinate() == [1, 1]; mesh.get_group("tp") is the group [2, 3];
            mesh["dp"] is the 1-D mesh [1, 3]; mesh.get_local_rank("dp") == 1

The groups of dimension ``d`` are the lines of the grid along ``d`` — the mesh with axis
``d`` moved last, read row by row (``dim_groups``) — created in that order, dimension
by dimension, exactly as torch's DeviceMesh does, so the same shape gives the same groups
(tests/test_mesh.py checks it against torch).  A dimension whose line is the whole world
reuses the world group.

Like ``new_group``, building a mesh is collective: every rank of the world calls it,
with the same arguments, in the same order as its other ``new_group`` calls.  Slicing
(``mesh["dp"]``, ``mesh["dp", "tp"]``) creates no groups: a sub-mesh shares its parent's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from chorus.api.groups import new_group
from chorus.api.init import init_process_group, is_initialized
from chorus.api.state import initialized_world
from chorus.errors import InvalidArgumentError
from chorus.process_group import ProcessGroup


class MeshDimError(InvalidArgumentError, KeyError):
    """A mesh dimension name or index that the mesh does not have (a KeyError, like torch's)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def dim_groups(mesh: np.ndarray, dim: int) -> list[list[int]]:
    """The rank lists of dimension ``dim``: every line of ``mesh`` along that axis.

    dim_groups([[0, 1], [2, 3]], 0) == [[0, 2], [1, 3]];  ... 1) == [[0, 1], [2, 3]]
    """
    mesh = np.asarray(mesh)
    return np.swapaxes(mesh, -1, dim).reshape(-1, mesh.shape[dim]).tolist()


class DeviceMesh:
    """An n-D grid of global ranks (``mesh``) with named dimensions and their groups."""

    def __init__(self, device_type: str, mesh, *, mesh_dim_names: Sequence[str] | None = None,
                 _groups: list[ProcessGroup | None] | None = None):
        world = initialized_world("DeviceMesh")
        _check_device(device_type)
        self.device_type = device_type
        self.mesh = np.array(mesh, dtype=np.int64)
        if self.mesh.ndim == 0 or self.mesh.size == 0:
            raise InvalidArgumentError(f"DeviceMesh: mesh must have at least one rank and one dimension, got {mesh!r}")
        ranks = self.mesh.reshape(-1).tolist()
        if len(set(ranks)) != len(ranks) or not all(0 <= r < world.world_size for r in ranks):
            raise InvalidArgumentError(
                f"DeviceMesh: mesh {self.mesh.tolist()} must hold distinct ranks of the world (0..{world.world_size - 1})")
        self._names = _check_names(mesh_dim_names, self.mesh.ndim)
        self._rank = world.rank
        where = np.argwhere(self.mesh == self._rank)
        self._coordinate = [int(c) for c in where[0]] if len(where) else None
        self._groups = _groups if _groups is not None else _create_groups(self.mesh, world)

    # -- shape ---------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._names

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along ``mesh_dim``."""
        return self.mesh.size if mesh_dim is None else self.mesh.shape[self._dim(mesh_dim)]

    # -- this rank -----------------------------------------------------------------------------
    def get_rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def get_coordinate(self) -> list[int] | None:
        """This rank's index along every dimension (None if it is not in the mesh)."""
        return None if self._coordinate is None else list(self._coordinate)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's rank in its group along ``mesh_dim`` (optional for a 1-D mesh)."""
        return self.get_group(mesh_dim).rank()

    # -- groups --------------------------------------------------------------------------------
    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """This rank's group along ``mesh_dim`` (optional for a 1-D mesh)."""
        if mesh_dim is None:
            if self.ndim > 1:
                raise InvalidArgumentError(
                    f"DeviceMesh.get_group: the mesh has {self.ndim} dimensions; pass mesh_dim "
                    "(an index or a name), or use get_all_groups()")
            mesh_dim = 0
        group = self._groups[self._dim(mesh_dim)]
        if group is None:
            raise InvalidArgumentError(f"DeviceMesh.get_group: rank {self._rank} is not in the mesh {self.mesh.tolist()}")
        return group

    def get_all_groups(self) -> list[ProcessGroup]:
        return [self.get_group(d) for d in range(self.ndim)]

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh of dimensions ``names`` (in mesh order) through this rank."""
        wanted = (names,) if isinstance(names, str) else tuple(names)
        dims = [self._dim(n, by_name_only=True) for n in wanted]
        if dims != sorted(dims) or len(set(dims)) != len(dims):
            raise MeshDimError(f"DeviceMesh: dimensions {wanted} must be distinct and in the mesh's order "
                               f"{self._names}")
        if self._coordinate is None:
            raise InvalidArgumentError(f"DeviceMesh: rank {self._rank} is not in the mesh {self.mesh.tolist()}")
        if dims == list(range(self.ndim)):
            return self
        index = tuple(slice(None) if d in dims else self._coordinate[d] for d in range(self.ndim))
        return DeviceMesh(self.device_type, self.mesh[index], mesh_dim_names=wanted,
                          _groups=[self._groups[d] for d in dims])

    def _dim(self, mesh_dim: int | str, by_name_only: bool = False) -> int:
        if isinstance(mesh_dim, str):
            if self._names is None or mesh_dim not in self._names:
                raise MeshDimError(f"DeviceMesh: no dimension named {mesh_dim!r}; the mesh's names are {self._names}")
            return self._names.index(mesh_dim)
        if by_name_only or not isinstance(mesh_dim, int) or not -self.ndim <= mesh_dim < self.ndim:
            raise MeshDimError(f"DeviceMesh: {mesh_dim!r} is not a dimension of a {self.ndim}-D mesh"
                               + (f" (names {self._names})" if self._names else ""))
        return mesh_dim % self.ndim

    # -- value semantics ---------------------------------------------------------------------
    def __repr__(self) -> str:
        names = "" if self._names is None else f", mesh_dim_names={self._names}"
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    def __eq__(self, other) -> bool:
        return (isinstance(other, DeviceMesh) and self.device_type == other.device_type
                and self._names == other._names and np.array_equal(self.mesh, other.mesh))

    def __hash__(self) -> int:
        return hash((self.device_type, self._names, self.mesh.shape, self.mesh.tobytes()))


def init_device_mesh(device_type: str, mesh_shape: Sequence[int],
                     mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    """A mesh of shape ``mesh_shape`` over the world, ranks in row-major order.

    Initializes the default group from the environment first if needed (as torch does);
    ``prod(mesh_shape)`` must equal the world size.  Every rank calls it.

    world of 4, every rank: mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
      -> rank 0: mesh.get_group("tp") is the group [0, 1], mesh.get_group("dp") the group [0, 2]
         rank 3: mesh.get_coordinate() == [1, 1], mesh.get_local_rank("dp") == 1
    """
    _check_device(device_type)
    shape = tuple(int(s) for s in mesh_shape)
    if not shape or min(shape) < 1:
        raise InvalidArgumentError(f"init_device_mesh: mesh_shape must be positive sizes, got {tuple(mesh_shape)}")
    if not is_initialized():
        init_process_group()
    world = initialized_world("init_device_mesh")
    if math.prod(shape) != world.world_size:
        raise InvalidArgumentError(
            f"init_device_mesh: mesh_shape {shape} holds {math.prod(shape)} ranks but the world has "
            f"{world.world_size}; the product of the sizes must equal the world size")
    _check_names(mesh_dim_names, len(shape))
    return DeviceMesh(device_type, np.arange(world.world_size).reshape(shape), mesh_dim_names=mesh_dim_names)


def _check_device(device_type: str) -> None:
    if device_type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"DeviceMesh: device_type {device_type!r}: chorus's groups carry CPU and CUDA tensors; "
            "use \"cpu\" or \"cuda\"")


def _check_names(names, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    names = tuple(names)
    if len(names) != ndim or len(set(names)) != ndim or not all(isinstance(n, str) for n in names):
        raise InvalidArgumentError(f"DeviceMesh: mesh_dim_names {names} must be {ndim} distinct strings, one per dimension")
    return names


def _create_groups(mesh: np.ndarray, world) -> list[ProcessGroup | None]:
    """Create every line's group, dimension by dimension (every rank calls new_group for
    every line, in the same order); return this rank's group per dimension."""
    everyone = list(range(world.world_size))
    mine: list[ProcessGroup | None] = []
    for dim in range(mesh.ndim):
        found = None
        for ranks in dim_groups(mesh, dim):
            group = world.default_group if sorted(ranks) == everyone else new_group(ranks)
            if world.rank in ranks:
                found = group
        mine.append(found)
    return mine
