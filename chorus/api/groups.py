"""Sub-groups: ``new_group``, ``new_subgroups``, ``new_subgroups_by_enumeration``, rank queries.

As in torch.distributed, every rank of the default group must call ``new_group`` (also
the ranks that are not members) in the same order; non-members receive
``GroupMember.NON_GROUP_MEMBER`` and ops on it do nothing.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from chorus.api.init import attach_components
from chorus.api.state import current, initialized_world
from chorus.errors import InvalidArgumentError
from chorus.process_group import ProcessGroup
from chorus.work import seconds

log = logging.getLogger("chorus")


class _NonGroupMember:
    """What ``new_group`` returns on ranks that are not in the new group."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class GroupMember:
    """torch's names: ``GroupMember.WORLD`` (the default group) and ``NON_GROUP_MEMBER``."""

    NON_GROUP_MEMBER = _NonGroupMember()

    class _World:
        def __get__(self, obj, owner) -> ProcessGroup | None:
            return current().default_group

    WORLD = _World()


class _GroupNamespace:
    """``chorus.group.WORLD`` is the default process group (None before init)."""

    @property
    def WORLD(self) -> ProcessGroup | None:  # noqa: N802 - torch's name
        return current().default_group


group = _GroupNamespace()


def resolve(group_arg, op: str) -> ProcessGroup | None:
    """The ProcessGroup an op runs on, or None if this rank is not a member (op is a no-op)."""
    world = initialized_world(op)
    if group_arg is None:
        return world.default_group
    if group_arg is GroupMember.NON_GROUP_MEMBER:
        return None
    if not isinstance(group_arg, ProcessGroup):
        raise InvalidArgumentError(f"{op}: group must be a ProcessGroup from new_group(), got {type(group_arg).__name__}")
    return group_arg if group_arg.is_member() else None


def new_group(ranks=None, timeout: timedelta | float | None = None, backend=None, pg_options=None,
              use_local_synchronization: bool = False, group_desc: str | None = None):
    """Create a group of the given global ranks (all ranks if None).

    Every rank must call it, in the same order.  Members get the group, non-members
    ``GroupMember.NON_GROUP_MEMBER``.  No communication happens: connections exist already.

    world of 4, every rank: g = new_group([0, 2])
      -> rank 0: g, get_rank(g) == 0   rank 2: g, get_rank(g) == 1
         rank 1, 3: GroupMember.NON_GROUP_MEMBER (an op on it does nothing and returns None)
    """
    world = initialized_world("new_group")
    members = _validate_ranks(ranks, world.world_size, "new_group")
    world.group_count += 1
    gid = world.group_count
    t = seconds(timeout)
    pg = ProcessGroup(gid, members, world.rank, world.transport,
                      world.default_group.timeout if t is None else t,
                      name=group_desc or f"group{gid}", backend=world.backend)
    pg.channels = world.channels
    world.groups[gid] = pg
    attach_components(pg)
    return pg if pg.is_member() else GroupMember.NON_GROUP_MEMBER


def _validate_ranks(ranks, world_size: int, op: str) -> tuple[int, ...]:
    if ranks is None:
        return tuple(range(world_size))
    members = tuple(int(r) for r in ranks)
    bad = [r for r in members if not 0 <= r < world_size]
    if bad:
        raise InvalidArgumentError(f"{op}: ranks {bad} are outside the world of size {world_size}")
    if len(set(members)) != len(members):
        raise InvalidArgumentError(f"{op}: ranks {list(members)} contain duplicates")
    if not members:
        raise InvalidArgumentError(f"{op}: ranks is empty; a group needs at least one rank")
    return tuple(sorted(members))


def new_subgroups(group_size: int | None = None, group=None, timeout=None, backend=None, pg_options=None,
                  group_desc: str | None = None):
    """Split the world into consecutive groups of ``group_size`` ranks.

    Returns ``(this rank's subgroup, [all subgroups])`` like torch.  ``group_size``
    defaults to the number of ranks on this host (LOCAL_WORLD_SIZE).

    world of 4, every rank: mine, all_ = new_subgroups(2)
      -> rank 0, 1: mine = the group [0, 1]   rank 2, 3: mine = the group [2, 3]
         every rank: all_ = [group [0, 1], group [2, 3]]
    """
    world = initialized_world("new_subgroups")
    size = group_size if group_size is not None else world.local_world_size
    if size <= 0 or world.world_size % size:
        raise InvalidArgumentError(
            f"new_subgroups: group_size {size} must be positive and divide the world size {world.world_size}"
        )
    ranks = [list(range(start, start + size)) for start in range(0, world.world_size, size)]
    return new_subgroups_by_enumeration(ranks, timeout=timeout, backend=backend)


def new_subgroups_by_enumeration(ranks_per_subgroup_list, timeout=None, backend=None, pg_options=None,
                                 group_desc: str | None = None):
    """Create one group per list of ranks; returns ``(this rank's subgroup or None, all)``.

    world of 4, every rank: mine, all_ = new_subgroups_by_enumeration([[0, 2], [1, 3]])
      -> rank 0, 2: mine = the group [0, 2]   rank 1, 3: mine = the group [1, 3]
    """
    world = initialized_world("new_subgroups_by_enumeration")
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        overlap = seen.intersection(ranks)
        if overlap:
            raise InvalidArgumentError(
                f"new_subgroups_by_enumeration: ranks {sorted(overlap)} appear in more than one subgroup"
            )
        seen.update(ranks)
    mine, subgroups = None, []
    for ranks in ranks_per_subgroup_list:
        pg = new_group(ranks, timeout=timeout, backend=backend)
        subgroups.append(pg)
        if world.rank in ranks:
            mine = pg
    return mine, subgroups


def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None):
    """Split ``parent_pg`` (default: the world) into disjoint groups (torch 2.13's API).

    ``split_ranks`` lists the groups as lists of *group ranks of the parent*.  Every rank
    of the parent calls it; each gets its own new group, or None if it is in no split.

    world of 4, every rank: g = split_group(split_ranks=[[0, 1], [2, 3]])
      -> rank 0, 1: g = the group [0, 1]   rank 2, 3: g = the group [2, 3]
    """
    world = initialized_world("split_group")
    parent = world.default_group if parent_pg is None else parent_pg
    if not isinstance(parent, ProcessGroup):
        raise InvalidArgumentError("split_group: this rank is not a member of parent_pg")
    if not split_ranks:
        raise InvalidArgumentError("split_group: split_ranks must be a non-empty list of lists of ranks")
    globals_ = [[parent.global_rank(r, op="split_group", what="rank in split_ranks") for r in ranks]
                for ranks in split_ranks]
    mine, _ = new_subgroups_by_enumeration(globals_, timeout=timeout)
    return mine


def get_process_group_ranks(group) -> list[int]:
    """Global ranks of ``group``'s members, in group-rank order.

    rank 1 or 3 of g = new_group([3, 1]): get_process_group_ranks(g) == [1, 3]
    """
    pg = initialized_world("get_process_group_ranks").default_group if group is None else group
    if pg is GroupMember.NON_GROUP_MEMBER:
        raise InvalidArgumentError("get_process_group_ranks: this rank is not a member of the group")
    return list(pg.members)


def get_group_rank(group, global_rank: int) -> int:
    """The group rank of ``global_rank`` in ``group``.

    rank 1 or 3 of g = new_group([1, 3]): get_group_rank(g, 3) == 1
    """
    pg = resolve(group, "get_group_rank") if group is not None else initialized_world("get_group_rank").default_group
    if pg is None:
        raise InvalidArgumentError("get_group_rank: this rank is not a member of the group")
    return pg.group_rank(global_rank, op="get_group_rank", what="global rank")


def get_global_rank(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group``.

    rank 1 or 3 of g = new_group([1, 3]): get_global_rank(g, 1) == 3
    """
    pg = resolve(group, "get_global_rank") if group is not None else initialized_world("get_global_rank").default_group
    if pg is None:
        raise InvalidArgumentError("get_global_rank: this rank is not a member of the group")
    return pg.global_rank(group_rank, op="get_global_rank", what="group rank")


def warn_not_in_group(op: str) -> None:
    log.warning("chorus: %s called by rank %d, which is not in the group; doing nothing",
                op, current().rank)
