"""Join the job and print one line per rank, ``REPORT {json}``: whether its connections are
authenticated, whether rank 0's store (where chorus serves it) and rank 1's transport
refuse a connection that proves no token, and whether an object of a class of this
script (not allow-listed: only an authenticated job unpickles it) went around.

``auth_report.py``: chorus's init_process_group; ``auth_report.py torch [INIT_METHOD]``:
torch's with backend "chorus" (only ``authenticated`` is reported)."""

import json
import os
import sys
from dataclasses import dataclass

from chorus import net
from chorus.errors import AuthenticationError


@dataclass
class Point:
    rank: int


def refuses(addr: str, purpose: bytes) -> bool:
    """Whether a connection that proves no token is refused by the endpoint at ``addr``."""
    host, _, port = addr.rpartition(":")
    sock = net.connect(host, int(port), 5.0)
    try:
        net.client_handshake(sock, None, purpose, 5.0)
    except AuthenticationError:
        return True
    finally:
        sock.close()
    return False


def chorus_job() -> dict:
    import chorus as dist
    from chorus.api.state import current
    from chorus.errors import UnsafeObjectError

    dist.init_process_group("chorus")
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {"rank": rank, "authenticated": dist.group.WORLD.transport.authenticated}
    if rank == 0:
        report["transport_refuses"] = refuses(current().store.get("tcp/addr/1").decode(), b"transport")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":  # torchrun's agent: torch's store
            port = os.environ.get("CHORUS_STORE_PORT") or os.environ["MASTER_PORT"]  # chorusrun's store: its own port
            report["store_refuses"] = refuses(f"{os.environ['MASTER_ADDR']}:{port}", b"store")
    dist.barrier()
    out = [None] * world
    try:
        dist.all_gather_object(out, Point(rank))
        report["objects"] = [p.rank for p in out]
    except UnsafeObjectError:
        report["objects"] = "refused"
    dist.barrier()
    dist.destroy_process_group()
    return report


def torch_job(init_method: str | None) -> dict:
    import torch.distributed as tdist

    import chorus.torch  # noqa: F401 - registers the backend

    tdist.init_process_group("chorus", init_method=init_method)
    tdist.barrier()
    group = tdist.group.WORLD.chorus_group  # torch's WORLD is chorus.torch's ChorusProcessGroup
    report = {"rank": tdist.get_rank(), "authenticated": group.transport.authenticated}
    tdist.destroy_process_group()
    return report


if __name__ == "__main__":
    result = torch_job((sys.argv[2:] or [None])[0]) if sys.argv[1:2] == ["torch"] else chorus_job()
    print("REPORT " + json.dumps(result), flush=True)
