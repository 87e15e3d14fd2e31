"""Which host a rank is on, and whether its ranks may share memory.

A host id is the machine's ``boot_id`` plus the device and inode of ``/dev/shm`` (so two
containers on one kernel with separate ``/dev/shm`` are two hosts), or ``CHORUS_HOST_ID``
(one value, or one per global rank: ``a,a,b,b``).  Ranks exchange its digest when a
group is made (chorus.shm.handshake) and when the TCP transport connects
(chorus.transport.shm_link).
"""

from __future__ import annotations

import hashlib
import os
import platform

from chorus import config
from chorus.host.segment import SHM_DIR

NO_HOST = bytes(32)  # the digest of a rank that cannot (or must not) use shared memory


def transport_mode() -> str:
    """``CHORUS_TRANSPORT``: ``auto`` (shared memory where every member shares a host, on
    CPUs whose store order the sync relies on), ``shm`` (force it, fail if impossible),
    ``tcp`` (never)."""
    return config.get("CHORUS_TRANSPORT")


def platform_ok() -> bool:
    """x86-64 (and x86) keep stores in order, which the counters rely on (chorus.shm.sync)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def host_id(global_rank: int) -> str | None:
    """This rank's host id (see above), or None when it has no usable ``/dev/shm``."""
    parts = config.get("CHORUS_HOST_ID")
    if parts:
        if len(parts) == 1:
            return parts[0]
        if global_rank >= len(parts):
            raise ValueError(f"CHORUS_HOST_ID lists {len(parts)} hosts but this is rank {global_rank}; "
                             "give one entry per rank, or a single value")
        return parts[global_rank]
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
