"""Free loopback ports for the GPU tests' jobs."""

from __future__ import annotations

import socket


def free_port(pair: bool = False) -> int:
    """A free port; with ``pair``, one whose successor is free too (chorus's store on the
    port, NCCL's on the next)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if not pair:
                return port
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
