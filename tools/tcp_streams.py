"""How fast loopback TCP moves a ring's bytes with one socket per neighbour, and with
several: the bound under a large all_reduce over TCP, and what more streams would lift.

W processes stand in a ring.  Each sends N bytes to its right neighbour while it receives
N bytes from its left one, over K sockets per neighbour: socket k carries bytes
[k N/K, (k+1) N/K), written in 1 MiB pieces by one thread and read by another (the main
thread writes socket 0).  No reduction, no framing: plain ``sendall`` / ``recv_into``,
the least any Python library pays per byte.  After each pass a one-byte token goes round
the ring so the passes stay in step.  Rank 0 prints the mean time of a pass and the rate
each way per rank::

    python3 tools/tcp_streams.py W K MIB [PASSES]       e.g.  python3 tools/tcp_streams.py 4 2 32

With K = 1 this is what a ring step of chorus (and of gloo) can reach at most; a ring
all_reduce of n bytes moves 2 (W - 1) / W n bytes each way per rank.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import numpy as np

PIECE = 1 << 20


def _ring_sockets(rank: int, world: int, streams: int, listeners: list[socket.socket]):
    """(right, left): ``streams`` sockets to the right neighbour and from the left one,
    in stream order."""
    right = []
    for k in range(streams):
        sock = socket.create_connection(listeners[(rank + 1) % world].getsockname())
        sock.sendall(bytes([k]))
        right.append(sock)
    left: list[socket.socket | None] = [None] * streams
    for _ in range(streams):
        sock, _ = listeners[rank].accept()
        left[sock.recv(1)[0]] = sock
    for sock in right + left:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return right, left


def _one_pass(right, left, src: np.ndarray, dst: np.ndarray) -> None:
    streams = len(right)
    part = src.size // streams

    def send(k: int) -> None:
        view = memoryview(src)[k * part:(k + 1) * part]
        for at in range(0, part, PIECE):
            right[k].sendall(view[at:at + PIECE])

    def receive(k: int) -> None:
        view = memoryview(dst)[k * part:(k + 1) * part]
        got = 0
        while got < part:
            got += left[k].recv_into(view[got:min(part, got + PIECE)])

    helpers = [threading.Thread(target=receive, args=(k,)) for k in range(streams)]
    helpers += [threading.Thread(target=send, args=(k,)) for k in range(1, streams)]
    for t in helpers:
        t.start()
    send(0)
    for t in helpers:
        t.join()
    right[0].sendall(b"t")
    left[0].recv(1)


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__)
        return 2
    world, streams, mib = int(argv[0]), int(argv[1]), int(argv[2])
    passes = int(argv[3]) if len(argv) == 4 else 8
    if world < 2 or streams < 1 or (mib << 20) % streams:
        print("W >= 2, K >= 1, and K must divide the bytes")
        return 2
    nbytes = mib << 20
    listeners = []
    for _ in range(world):
        lis = socket.socket()
        lis.bind(("127.0.0.1", 0))
        lis.listen(streams)
        listeners.append(lis)
    rank = 0
    children = []
    for r in range(1, world):
        pid = os.fork()
        if pid == 0:
            rank = r
            break
        children.append(pid)
    right, left = _ring_sockets(rank, world, streams, listeners)
    src = np.ones(nbytes, np.uint8)
    dst = np.empty(nbytes, np.uint8)
    for _ in range(2):
        _one_pass(right, left, src, dst)
    start = time.perf_counter()
    for _ in range(passes):
        _one_pass(right, left, src, dst)
    seconds = (time.perf_counter() - start) / passes
    if rank != 0:
        os._exit(0)
    for pid in children:
        os.waitpid(pid, 0)
    print(f"W={world:2d} K={streams} {mib} MiB: {seconds * 1e3:8.2f} ms a pass, "
          f"{nbytes / seconds / 1e9:5.2f} GB/s each way per rank", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
