"""Free loopback ports for the GPU tests' jobs."""

from __future__ import annotations

import random
import socket


def _ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(pair: bool = False) -> int:
    """A free port; with ``pair``, one whose successor is free too (chorus's store on the
    port, NCCL's on the next).  Drawn outside the kernel's ephemeral range: a port from
    inside it can be taken, between this check and the job's listen, as the local end of
    one of the job's own outgoing connections (EADDRINUSE on the listen)."""
    low, high = _ephemeral()
    span = (10000, low - 2) if low > 12000 else (high + 1, 65534)  # below the range, else above it
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(*span)
        if _free(port) and (not pair or _free(port + 1)):
            return port
    raise RuntimeError("no free loopback port outside the ephemeral range")
