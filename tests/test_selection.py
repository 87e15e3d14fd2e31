"""The default algorithm rules (chorus.selection): where each all_reduce algorithm starts."""

import pytest

from chorus.selection import KIB, MIB, default_algorithm


@pytest.mark.parametrize("world, nbytes, want", [
    (4, 4, "recursive_doubling"),
    (4, 32 * KIB, "recursive_doubling"),
    (4, 32 * KIB + 4, "rabenseifner"),
    (8, 256 * KIB, "recursive_doubling"),
    (8, 256 * KIB + 4, "rabenseifner"),
    (2, 16 * MIB - 4, "rabenseifner"),
    (2, 16 * MIB, "ring"),  # ring's pipeline from 16 MiB (docs/results/16-vcpu-xeon/tcp-ring-16m/)
    (4, 16 * MIB, "ring"),
    (4, 8 * MIB - 4, "rabenseifner"),
    (4, 8 * MIB, "ring"),  # W = 4 from 8 MiB (docs/results/16-vcpu-h200-host/tcp-large/)
    (8, 8 * MIB, "rabenseifner"),
    (16, 256 * MIB, "ring"),
])
def test_all_reduce_by_size_and_world(world, nbytes, want):
    assert default_algorithm("all_reduce", world, nbytes) == want


class _Group:
    """What ScheduleComponent.schedule reads of a group."""

    def __init__(self, size):
        self._size = size

    def rank(self):
        return 0

    def size(self):
        return self._size


def _largest_send(world, monkeypatch, segment_bytes=None):
    from chorus.components.schedules import ScheduleComponent
    from chorus.schedules.base import Send

    monkeypatch.delenv("CHORUS_SEGMENT_BYTES", raising=False)
    if segment_bytes is not None:
        monkeypatch.setenv("CHORUS_SEGMENT_BYTES", str(segment_bytes))
    count = (64 * MIB) // 4
    sched = ScheduleComponent().schedule(_Group(world), "all_reduce", "ring", {"count": count}, -1, 4)
    return max(op.src.count for step in sched for op in step if isinstance(op, Send)) * 4


def test_a_ring_all_reduce_of_sixteen_ranks_sends_whole_chunks_unless_the_segment_is_set(monkeypatch):
    assert _largest_send(8, monkeypatch) == MIB  # 8 MiB chunks in 1 MiB pieces
    assert _largest_send(16, monkeypatch) == 4 * MIB  # whole 4 MiB chunks
    assert _largest_send(16, monkeypatch, segment_bytes=MIB) == MIB  # as set
