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
