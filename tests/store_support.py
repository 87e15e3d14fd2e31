"""What the store tests share: the job token and a client of the ``server`` fixture
(which lives in conftest.py)."""

from __future__ import annotations

from chorus.store import TCPStore

TOKEN = b"test-token"


def tcp_client(server, timeout=5.0) -> TCPStore:
    return TCPStore("127.0.0.1", server.port, timeout=timeout, token=TOKEN)
