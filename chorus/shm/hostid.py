"""Which ranks share a host — in the sense that matters for shared memory.

Two ranks can use a shared-memory window when they run on the same machine *and* see
the same ``/dev/shm``.  LOCAL_RANK / LOCAL_WORLD_SIZE say neither (containers, odd
launchers, several jobs per node): a Gloo shared-memory all-reduce was merged and
reverted for trusting them.  So the id is built from what the kernel says:

    boot_id               /proc/sys/kernel/random/boot_id: this machine, this boot
    /dev/shm st_dev, ino  which tmpfs instance (a container with its own /dev/shm differs)

Ranks with equal ids are then *verified*: the segment's creator writes a random nonce
into it and every member checks it reads that nonce through its own mapping (see
chorus.shm.handshake).  Containers that share ``/dev/shm`` (``--ipc=host``) get one id
and shared memory, whatever their hostnames.

``CHORUS_HOST_ID`` overrides the detection, for tests: one value for this process, or a
comma-separated list indexed by global rank (ranks as threads of one process can then
pretend to live on different hosts): ``CHORUS_HOST_ID=a,a,b,b``.
"""

from __future__ import annotations

import hashlib
import os

from chorus.shm.segment import SHM_DIR

NO_HOST = bytes(32)  # the digest of a rank that cannot (or must not) use shared memory


def host_id(global_rank: int) -> str | None:
    """This rank's host id, or None when it has no usable ``/dev/shm``."""
    override = os.environ.get("CHORUS_HOST_ID", "")
    if override:
        parts = override.split(",")
        if len(parts) == 1:
            return override
        if global_rank >= len(parts):
            raise ValueError(f"CHORUS_HOST_ID lists {len(parts)} hosts but this is rank {global_rank}; "
                             "give one entry per rank, or a single value")
        return parts[global_rank].strip()
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return None
    if not os.access(SHM_DIR, os.W_OK):
        return None
    return f"{boot}/{st.st_dev}:{st.st_ino}"


def host_digest(global_rank: int) -> bytes:
    """32 bytes naming this rank's host (NO_HOST when shared memory is unavailable)."""
    hid = host_id(global_rank)
    return NO_HOST if hid is None else hashlib.sha256(hid.encode()).digest()
