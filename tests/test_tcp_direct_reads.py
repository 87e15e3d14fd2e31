"""The TCP transport's receive path (chorus.transport.tcp_receive): a thread waiting for a
small receive reads the socket itself, and every frame is still read, whoever reads it."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from chorus import config
from chorus.errors import PeerLostError
from chorus.store import HashStore
from chorus.transport.tcp import TcpTransport
from chorus.wire.frames import Kind

TOKEN = b"direct-reads-test-token"


@pytest.fixture
def pair():
    """Two real TcpTransports (ranks 0 and 1) in this process, sockets only."""
    store = HashStore()
    ranks: dict[int, TcpTransport] = {}
    with config.override(CHORUS_SHM_P2P=False):
        threads = [threading.Thread(target=lambda r=r: ranks.__setitem__(
            r, TcpTransport(r, 2, store, token=TOKEN, timeout=10.0))) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
    assert len(ranks) == 2
    yield ranks[0], ranks[1]
    for t in ranks.values():
        t.close()


def _send(t: TcpTransport, peer: int, data: bytes, tag: int):
    return t.isend(peer, memoryview(data), kind=Kind.DATA, group=0, tag=tag, sync=True)


def _recv(t: TcpTransport, peer: int, nbytes: int, tag: int, **kw):
    return t.irecv(peer, memoryview(bytearray(nbytes)), kind=Kind.DATA, group=0, tag=tag, **kw)


def _wait(t: TcpTransport, handles, seconds: float = 10.0) -> None:
    t.wait_all(handles, time.monotonic() + seconds, lambda: "test")


def test_the_waiting_thread_reads_its_small_receives(pair):
    """Ping-pong: the replies' receives complete (their ``finish`` runs) in the thread that
    waits for them, not only in the reader thread."""
    t0, t1 = pair
    readers: list[str] = []

    def echo():
        for _ in range(200):
            h = _recv(t1, 0, 8, tag=1, waited=True)
            _wait(t1, [h])
            _wait(t1, [_send(t1, 0, bytes(h.view), tag=2)])

    threading.Thread(target=echo, daemon=True).start()
    for i in range(200):
        reply = _recv(t0, 1, 8, tag=2, waited=True,
                      finish=lambda: readers.append(threading.current_thread().name))
        _wait(t0, [_send(t0, 1, i.to_bytes(8, "little"), tag=1)])
        _wait(t0, [reply])
        assert int.from_bytes(reply.view, "little") == i
    assert readers.count(threading.current_thread().name) > 0, set(readers)


def _echo_readers(t0: TcpTransport, t1: TcpTransport, nbytes: int, receives: int) -> list[str]:
    """Rank 1 sends ``receives`` messages of ``nbytes`` per round, each its own tag, and
    rank 0 waits for them in one wait; the names of the threads that completed rank 0's
    receives (their ``finish``), after 50 rounds whose payloads all arrived intact."""
    readers: list[str] = []
    payloads = [bytes([k + 1]) * nbytes for k in range(receives)]
    for _ in range(50):
        handles = [_recv(t0, 1, nbytes, tag=10 + k, waited=True,
                         finish=lambda: readers.append(threading.current_thread().name)) for k in range(receives)]
        sent = [t1.isend(0, memoryview(p), kind=Kind.DATA, group=0, tag=10 + k) for k, p in enumerate(payloads)]
        _wait(t0, handles)
        _wait(t1, sent)
        assert [bytes(h.view) for h in handles] == payloads
    return readers


def test_a_lone_large_receive_is_read_by_the_waiting_thread(pair):
    """A wait for one 256 KiB receive (a ring step's) reads it in the waiting thread, as
    it reads small ones: ping-pong, rank 1 replying from a thread of its own, so that each
    reply arrives while rank 0 already waits for it (a frame already there when nobody
    waits is the reader thread's)."""
    t0, t1 = pair
    readers: list[str] = []
    payload = bytes(range(256)) * 1024

    def echo():
        for _ in range(100):
            h = _recv(t1, 0, 8, tag=1, waited=True)
            _wait(t1, [h])
            _wait(t1, [_send(t1, 0, payload, tag=2)])

    threading.Thread(target=echo, daemon=True).start()
    for i in range(100):
        reply = _recv(t0, 1, len(payload), tag=2, waited=True,
                      finish=lambda: readers.append(threading.current_thread().name))
        _wait(t0, [_send(t0, 1, i.to_bytes(8, "little"), tag=1)])
        _wait(t0, [reply])
        assert bytes(reply.view) == payload
    assert readers.count(threading.current_thread().name) > 0, set(readers)


def test_large_receives_waited_for_together_are_left_to_the_reader_threads(pair):
    """Two 256 KiB receives in one wait: the reader thread reads them (the waiting thread
    would take them one after the other), and both arrive intact."""
    readers = _echo_readers(*pair, 256 * 1024, 2)
    assert readers.count(threading.current_thread().name) < len(readers), set(readers)


@pytest.mark.parametrize("first", ["large", "small"])
def test_a_large_frame_next_to_an_awaited_small_one_is_read(pair, first):
    """Rank 1 sends a 1 MiB message and a 4-byte one (in either order); rank 0 waits for
    the small one first, then posts and waits for the large one: both arrive intact."""
    t0, t1 = pair
    big = bytes(range(256)) * 4096
    sends = {"large": (big, 1), "small": (b"abcd", 2)}
    order = ["large", "small"] if first == "large" else ["small", "large"]
    handles = [_send(t1, 0, *sends[name]) for name in order]
    small = _recv(t0, 1, 4, tag=2, waited=True)
    _wait(t0, [small])
    large = _recv(t0, 1, len(big), tag=1, waited=True)
    _wait(t0, [large])
    _wait(t1, handles)
    assert bytes(small.view) == b"abcd" and bytes(large.view) == big


def test_a_receive_nobody_waits_for_completes(pair):
    """After direct reads (the reader thread parked), a receive posted without a waiter
    still completes: its callback runs without anyone calling wait."""
    t0, t1 = pair
    for _ in range(20):
        h = _recv(t0, 1, 4, tag=3, waited=True)
        _wait(t1, [_send(t1, 0, b"ping", tag=3)])
        _wait(t0, [h])
    done = threading.Event()
    h = _recv(t0, 1, 4, tag=4)
    h.add_done_callback(lambda _: done.set())
    _wait(t1, [_send(t1, 0, b"pong", tag=4)])
    assert done.wait(5.0) and bytes(h.view) == b"pong"


def test_a_peer_lost_while_nobody_waits_is_noticed(pair):
    """After direct reads, rank 1's connection breaks while rank 0 waits for nothing: rank
    0 still notices within two seconds (its parked reader thread reads the EOF)."""
    t0, t1 = pair
    for _ in range(20):
        h = _recv(t0, 1, 4, tag=5, waited=True)
        _wait(t1, [_send(t1, 0, b"ping", tag=5)])
        _wait(t0, [h])
    t1._conns[0].sock.shutdown(socket.SHUT_RDWR)  # rank 0 sees EOF without a BYE
    start = time.monotonic()
    while 1 not in t0.dead and time.monotonic() < start + 5.0:
        time.sleep(0.01)
    assert 1 in t0.dead and time.monotonic() - start < 2.0
    with pytest.raises(PeerLostError):
        _wait(t0, [_recv(t0, 1, 4, tag=6, waited=True)], 5.0)
