"""What one benchmark iteration does, for each collective, written once against the
torch.distributed API — so the same code times chorus (``import chorus``) and torch's
gloo (``torch.distributed``): ``api`` is either module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def make_step(api: Any, collective: str, send: Any, recv: Any, rank: int, world: int) -> Callable[[], None]:
    """A zero-argument function running one iteration of ``collective``."""
    if collective == "sendrecv":
        nxt, prv = (rank + 1) % world, (rank - 1) % world

        def step() -> None:
            reqs = [api.irecv(recv, src=prv), api.isend(send, dst=nxt)]
            for req in reqs:
                req.wait()

        return step
    if collective == "barrier":
        return lambda: api.barrier()
    raise ValueError(f"chorus bench: collective {collective!r} is not benchmarked yet; "
                     "available: sendrecv, barrier")


def expected_recv(collective: str, rank: int, world: int) -> float | None:
    """The value every received element must hold (send buffers hold ``rank + 1``)."""
    if collective == "sendrecv":
        return float((rank - 1) % world + 1)
    return None
