"""The TCP transport's receive path (chorus.transport.tcp_receive): a thread waiting for a
small receive reads the socket itself, and every frame is still read, whoever reads it."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from chorus import config
from chorus.errors import CollectiveMismatchError, CommTimeoutError, PeerLostError
from chorus.store import HashStore
from chorus.transport import tcp_receive
from chorus.transport.base import Transport
from chorus.transport.tcp import TcpTransport
from chorus.wire.frames import Kind

TOKEN = b"direct-reads-test-token"


def _transports(world: int, rings: bool = False):
    """``world`` real TcpTransports (ranks 0, 1, ...) in this process, sockets only (with
    ``rings``: and shared-memory rings for payloads from CHORUS_SHM_P2P_MIN); closed after
    the test."""
    store = HashStore()
    ranks: dict[int, TcpTransport] = {}
    with config.override(CHORUS_SHM_P2P=rings):
        threads = [threading.Thread(target=lambda r=r: ranks.__setitem__(
            r, TcpTransport(r, world, store, token=TOKEN, timeout=10.0))) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
    assert len(ranks) == world
    yield tuple(ranks[r] for r in range(world))
    for t in ranks.values():
        t.close()


@pytest.fixture
def pair():
    """Ranks 0 and 1."""
    yield from _transports(2)


@pytest.fixture
def ring_pair():
    """Ranks 0 and 1 with shared-memory rings between them (one host)."""
    yield from _transports(2, rings=True)


@pytest.fixture
def trio():
    """Ranks 0, 1 and 2."""
    yield from _transports(3)


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


def _ping_pong_readers(t0: TcpTransport, t1: TcpTransport, payload: bytes, rounds: int) -> list[str]:
    """Ping-pong: rank 0 sends 8 bytes, rank 1 replies ``payload`` from a thread of its own,
    so that each reply arrives while rank 0 already waits for it (a frame already there when
    nobody waits is the reader thread's).  The names of the threads that completed rank 0's
    receives (their ``finish``), after every reply arrived intact."""
    readers: list[str] = []

    def echo():
        for _ in range(rounds):
            h = _recv(t1, 0, 8, tag=1, waited=True)
            _wait(t1, [h])
            _wait(t1, [_send(t1, 0, payload, tag=2)])

    threading.Thread(target=echo, daemon=True).start()
    for i in range(rounds):
        reply = _recv(t0, 1, len(payload), tag=2, waited=True,
                      finish=lambda: readers.append(threading.current_thread().name))
        _wait(t0, [_send(t0, 1, i.to_bytes(8, "little"), tag=1)])
        _wait(t0, [reply])
        assert bytes(reply.view) == payload
    return readers


def test_a_lone_large_receive_is_read_by_the_waiting_thread(pair):
    """A wait for one 256 KiB receive (a ring step's) reads it in the waiting thread, as
    it reads small ones."""
    readers = _ping_pong_readers(*pair, bytes(range(256)) * 1024, 100)
    assert readers.count(threading.current_thread().name) > 0, set(readers)


def test_a_lone_receive_through_a_ring_is_read_by_the_waiting_thread(ring_pair):
    """The same for a same-host peer whose large payloads come through a shared-memory
    ring: the waiting thread reads the 1 MiB replies itself (no reader thread's wake-up
    and hand-over of the GIL), and they went through the ring."""
    t0, t1 = ring_pair
    payload = bytes(range(256)) * 4096
    readers = _ping_pong_readers(t0, t1, payload, 50)
    assert t0.shm_p2p_stats()[1][1] == 50 * len(payload)  # (every reply through the ring)
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


def _on_hold(monkeypatch, t: TcpTransport, before=None, after=None) -> list[int]:
    """Run ``before()`` and ``after()`` around the matcher's ``hold`` on ``t``: recv_now
    holds its receive once it has taken the read role and found nothing posted or stashed
    ahead of it, so ``after`` runs while this thread reads the peer's connection and no
    other thread may.  Returns a list that counts the holds."""
    matcher, held = t._matcher, []
    hold = matcher.hold

    def hooked(handle):
        if before is not None:
            before()
        hold(handle)
        held.append(1)
        if after is not None:
            after()

    monkeypatch.setattr(matcher, "hold", hooked)
    return held


def _noting_stashes(monkeypatch, t: TcpTransport) -> threading.Event:
    """An event set once ``t`` stashes a frame (no receive was posted for it)."""
    stashed, stash = threading.Event(), t.stashed

    def noting(source, header):
        stash(source, header)
        stashed.set()

    monkeypatch.setattr(t, "stashed", noting)
    return stashed


def _while_reading(monkeypatch, t: TcpTransport, path: str, before=None, after=None) -> list[int]:
    """Run ``before()`` and ``after()`` once ``t``'s recv_now reads rank 1's connection for a
    collective's receive, on either of its paths: "taken" (it reads until the frame it
    knows byte for byte is there: ``_take_now``; the hooks run around its first look at
    the buffer) or "held" (``_take_now`` off: it holds its receive with the matcher, see
    _on_hold).  Returns a list that counts the runs."""
    if path == "held":
        monkeypatch.setattr(t, "_take_now", lambda *a: False)
        return _on_hold(monkeypatch, t, before, after)
    reader, ran = t._conns[1].reader, []
    take = reader.take

    def hooked(header, dst):
        if not ran:
            ran.append(1)
            if before is not None:
                before()
            if after is not None:
                after()
        return take(header, dst)

    monkeypatch.setattr(reader, "take", hooked)
    return ran


def test_recv_now_takes_its_own_frame_and_stashes_the_others(pair, monkeypatch):
    """``recv_now`` reads for a receive it does not post: a frame of another key that
    comes first is stashed for its own receive, the frame of its key fills it, and the
    matcher never holds the receive as posted."""
    t0, t1 = pair
    # both frames are written while rank 0 holds the read role, reading for tag 7
    held = _on_hold(monkeypatch, t0, after=lambda: _wait(t1, [_send(t1, 0, b"other", tag=8),
                                                             _send(t1, 0, b"mine!", tag=7)]))
    view = memoryview(bytearray(5))
    assert t0.recv_now(1, view, int(Kind.DATA), 0, 7, 0, None, None, time.monotonic() + 10.0) is None
    assert held == [1] and bytes(view) == b"mine!"
    assert t0._matcher.find_posted(lambda h: True) is None
    other = _recv(t0, 1, 5, tag=8, waited=True)
    _wait(t0, [other])
    assert bytes(other.view) == b"other"


@pytest.mark.parametrize("path", ["taken", "held"])
def test_a_receive_recv_now_holds_fails_at_once_when_its_group_breaks(pair, monkeypatch, path):
    """A failure recorded while ``recv_now`` reads for its (unposted) receive fails it at
    once, as it fails posted ones, rather than after the thread's reading time (made 30 s
    here, so that the two cannot be confused under load)."""
    t0, _ = pair
    monkeypatch.setattr(tcp_receive, "DIRECT_S", 30.0)
    held = threading.Event()
    breaker = threading.Thread(target=lambda: held.wait(10) and t0.group_mismatch(0, 1, 3, 0x1234, 1))
    breaker.start()
    ran = _while_reading(monkeypatch, t0, path, after=held.set)
    start = time.monotonic()
    h = t0.recv_now(1, memoryview(bytearray(4)), int(Kind.COLL), 0, 5, 0, (3, 0x99), None,
                    time.monotonic() + 60.0)
    took = time.monotonic() - start
    breaker.join(10)
    assert held.is_set() and ran == [1]
    assert h is not None and isinstance(h.error, CollectiveMismatchError)
    assert took < 10.0, took


@pytest.mark.parametrize("path", ["taken", "held"])
def test_a_peer_lost_while_recv_now_reads_fails_its_receive(pair, monkeypatch, path):
    """The peer's connection ends while ``recv_now`` reads for its receive: PeerLostError
    at once, not a wait until the reading time or the deadline."""
    t0, t1 = pair
    monkeypatch.setattr(tcp_receive, "DIRECT_S", 30.0)
    ran = _while_reading(monkeypatch, t0, path, after=lambda: t1._conns[0].sock.shutdown(socket.SHUT_RDWR))
    start = time.monotonic()
    h = t0.recv_now(1, memoryview(bytearray(4)), int(Kind.COLL), 0, 5, 0, (3, 0x99), None,
                    time.monotonic() + 60.0)
    assert h is not None and isinstance(h.error, PeerLostError), h and h.error
    assert time.monotonic() - start < 10.0 and ran == [1]
    with pytest.raises(PeerLostError):
        _wait(t0, [h])


def test_recv_now_times_out_and_leaves_nothing_posted(pair):
    """A silent peer: ``recv_now`` reads until the op's deadline at most, hands back its
    receive, and the wait raises CommTimeoutError and withdraws it (a late frame is
    stashed, never written into a buffer nobody owns)."""
    t0, _ = pair
    deadline = time.monotonic() + 0.3
    h = t0.recv_now(1, memoryview(bytearray(4)), int(Kind.COLL), 0, 5, 0, (3, 0x99), None, deadline)
    assert h is not None and not h.done()
    with pytest.raises(CommTimeoutError, match=r"no answer from ranks \[1\]"):
        t0.wait_all([h], deadline, lambda: "test")
    assert t0._matcher.find_posted(lambda h: True) is None


@pytest.mark.parametrize("path", ["taken", "held"])
def test_recv_now_checks_frames_stashed_before_it_held_its_receive(trio, monkeypatch, path):
    """Another call's frame from a third rank, stashed after ``recv_now`` looked for
    stashes and before it held its receive, is checked against it once held (as ``irecv``
    checks the stash once its receive is posted): the receive fails with
    CollectiveMismatchError even though its own frame arrives intact."""
    t0, t1, t2 = trio
    stashed = _noting_stashes(monkeypatch, t0)

    def rank_2_calls_something_else():
        # op 3 of group 0 with another fingerprint, read and stashed by rank 0's reader thread
        _wait(t2, [t2.isend(0, memoryview(b"xxxx"), kind=int(Kind.COLL), group=0, tag=5, seq=3,
                            fingerprint=0x77, sync=True)])
        assert stashed.wait(10)

    def rank_1_sends_its_part():
        _wait(t1, [t1.isend(0, memoryview(b"yyyy"), kind=int(Kind.COLL), group=0, tag=5, seq=3,
                            fingerprint=0x99, sync=True)])

    held = _while_reading(monkeypatch, t0, path, before=rank_2_calls_something_else, after=rank_1_sends_its_part)
    h = t0.recv_now(1, memoryview(bytearray(4)), int(Kind.COLL), 0, 5, 0, (3, 0x99), None,
                    time.monotonic() + 10.0)
    assert held == [1]
    assert h is not None and isinstance(h.error, CollectiveMismatchError), h and h.error
    assert 0 in t0.mismatched


def test_a_send_now_never_overtakes_a_queued_send(pair):
    """A large asynchronous send goes to the sender thread's queue; a small ``send_now``
    of the same key right after it leaves after it (the receives, posted in order, match
    the frames in order: overtaking would put the small frame into the large receive)."""
    t0, t1 = pair
    big = bytes(range(256)) * 4096  # 1 MiB: above INLINE_MAX, queued
    for i in range(5):
        first = _recv(t1, 0, len(big), tag=9)
        second = _recv(t1, 0, 4, tag=9)
        queued = t0.isend(1, memoryview(big), kind=int(Kind.DATA), group=0, tag=9)
        small = t0.send_now(1, memoryview(i.to_bytes(4, "little")), int(Kind.DATA), 0, 9, 0, 0, 0)
        _wait(t0, [queued] + ([small] if small is not None else []))
        _wait(t1, [first, second])
        assert bytes(first.view) == big and int.from_bytes(second.view, "little") == i


def test_reads_now_is_what_recv_now_reads_itself(pair):
    """The lane posts a lone receive before its sends unless the transport reads it at
    once (``reads_now``): small ones over TCP, none over the base transport."""
    t0, _ = pair
    assert t0.reads_now(1, tcp_receive.DIRECT_MAX) and not t0.reads_now(1, tcp_receive.DIRECT_MAX + 1)
    assert not t0.reads_now(0, 4)  # no connection to itself
    assert Transport.reads_now(t0, 1, 4) is False


def test_recv_now_takes_a_frame_it_knows_without_posting_or_holding(pair, monkeypatch):
    """A collective's receive knows every byte of its frame's header (kind, group, tag, the
    op's seq and fingerprint, size, dtype): recv_now copies the payload out of the
    connection's buffer with no Handle, no hold and no header parsing, runs ``finish``,
    and a frame that came right behind it is read for its own receive."""
    t0, t1 = pair
    held = _on_hold(monkeypatch, t0)
    ran = _while_reading(monkeypatch, t0, "taken", after=lambda: _wait(t1, [
        t1.isend(0, memoryview(b"abcd"), kind=int(Kind.COLL), group=0, tag=5, seq=3, fingerprint=0x99, dtype=2,
                 sync=True),
        t1.isend(0, memoryview(b"next"), kind=int(Kind.COLL), group=0, tag=5, seq=4, fingerprint=0x98, dtype=2,
                 sync=True)]))
    finished = []
    view = memoryview(bytearray(4))
    assert t0.recv_now(1, view, int(Kind.COLL), 0, 5, 2, (3, 0x99), lambda: finished.append(1),
                       time.monotonic() + 10.0) is None
    assert bytes(view) == b"abcd" and finished == [1] and ran == [1] and held == []
    later = memoryview(bytearray(4))
    h = t0.recv_now(1, later, int(Kind.COLL), 0, 5, 2, (4, 0x98), None, time.monotonic() + 10.0)
    if h is not None:
        _wait(t0, [h])
    assert bytes(later) == b"next"


@pytest.mark.parametrize("theirs", [(3, 0x77), (2, 0x99)], ids=["other-fingerprint", "other-seq"])
def test_a_frame_recv_now_does_not_know_goes_the_usual_way(pair, monkeypatch, theirs):
    """A frame whose header differs from the one the receive knows (another call) is not
    taken: the usual path reads it and fails the receive with CollectiveMismatchError."""
    t0, t1 = pair
    ran = _while_reading(monkeypatch, t0, "taken", after=lambda: _wait(t1, [
        t1.isend(0, memoryview(b"abcd"), kind=int(Kind.COLL), group=0, tag=5, seq=theirs[0], fingerprint=theirs[1],
                 sync=True)]))
    h = t0.recv_now(1, memoryview(bytearray(4)), int(Kind.COLL), 0, 5, 0, (3, 0x99), None, time.monotonic() + 10.0)
    assert ran == [1]
    assert h is not None and isinstance(h.error, CollectiveMismatchError), h and h.error


@pytest.mark.parametrize("path", ["taken", "held"])
def test_a_third_ranks_other_call_fails_a_waiting_recv_now_at_once(trio, monkeypatch, path):
    """Rank 2's frame of another call (op 3, another fingerprint) is stashed while
    recv_now waits for rank 1, which sends nothing (its heartbeats held back, so that none
    ends the wait early): CollectiveMismatchError at once, as ``stashed`` fails a held
    receive, not after the thread's reading time (30 s here) or the deadline."""
    t0, t1, t2 = trio
    monkeypatch.setattr(tcp_receive, "DIRECT_S", 30.0)
    monkeypatch.setattr(t1, "_beat", lambda *a: None)
    reading = threading.Event()

    def rank_2_calls_something_else():
        reading.wait(10)
        _wait(t2, [t2.isend(0, memoryview(b"xxxx"), kind=int(Kind.COLL), group=0, tag=5, seq=3,
                            fingerprint=0x77, sync=True)])

    threading.Thread(target=rank_2_calls_something_else, daemon=True).start()
    ran = _while_reading(monkeypatch, t0, path, after=reading.set)
    start = time.monotonic()
    h = t0.recv_now(1, memoryview(bytearray(4)), int(Kind.COLL), 0, 5, 0, (3, 0x99), None,
                    time.monotonic() + 15.0)
    took = time.monotonic() - start
    assert ran == [1]
    assert h is not None and isinstance(h.error, CollectiveMismatchError), h and h.error
    assert took < 5.0, took


class _WatchedLock:
    """A connection's role lock that notes, whenever the test's thread lets go of it, whether
    a whole frame is left in the connection's buffer."""

    def __init__(self, lock, reader, owner):
        self._lock, self._reader, self._owner, self.left = lock, reader, owner, []

    def acquire(self, blocking=True, timeout=-1):
        return self._lock.acquire(blocking, timeout)

    def release(self):
        if threading.current_thread() is self._owner:
            n = self._reader.frame_buffered()
            if n >= 0 and tcp_receive.HEADER_SIZE + n <= self._reader.buffered():
                self.left.append(n)
        self._lock.release()

    def locked(self):
        return self._lock.locked()


def test_recv_now_lets_go_of_the_role_with_no_whole_frame_buffered(trio, monkeypatch):
    """The module's rule, "it lets go of the role ... with no complete frame left
    in the connection's buffer (a frame the reader thread's poll would not see)".
    _take_now buffers rank 1's frame of another key and falls back; the usual path then
    fails the receive at once (another call's frame stashed from rank 2) without reading it."""
    t0, t1, t2 = trio
    stashed = _noting_stashes(monkeypatch, t0)
    conn = t0._conns[1]
    watched = _WatchedLock(conn.role.lock, conn.reader, threading.current_thread())
    monkeypatch.setattr(conn.role, "lock", watched)

    def before():
        _wait(t2, [t2.isend(0, memoryview(b"xxxx"), kind=int(Kind.COLL), group=0, tag=5, seq=3,
                            fingerprint=0x77, sync=True)])
        assert stashed.wait(10)
        _wait(t1, [_send(t1, 0, b"zz", tag=9)])  # another key: not the frame recv_now knows
        assert conn.reader.readable(5)

    ran = _while_reading(monkeypatch, t0, "taken", before=before)
    h = t0.recv_now(1, memoryview(bytearray(4)), int(Kind.COLL), 0, 5, 0, (3, 0x99), None,
                    time.monotonic() + 10.0)
    assert ran == [1]
    assert h is not None and isinstance(h.error, CollectiveMismatchError), h and h.error
    assert watched.left == [], f"let go of the role with whole frames buffered: {watched.left}"


def _exchange(t: TcpTransport, peer: int, out: bytes, nbytes: int, seq: int = 3, fingerprint: int = 0x99,
              finish=None):
    """``t.exchange_now`` of a collective's step (tag 5, dtype 2) with ``peer``: (what is
    left to wait for, the receive's view)."""
    into = memoryview(bytearray(nbytes))
    left = t.exchange_now(peer, memoryview(out), into, int(Kind.COLL), 0, 5, 5, seq, 2, fingerprint, finish,
                          time.monotonic() + 10.0)
    return left, into


def test_exchange_now_swaps_with_one_peer_without_posting_or_holding(pair, monkeypatch):
    """Both ranks of a step exchange: each writes its frame whole and takes the peer's by
    its known header (no receive posted or held), then runs ``finish``.  Rank 1, which
    holds its read role before rank 0's frame comes, never goes the usual way."""
    t0, t1 = pair
    held = _on_hold(monkeypatch, t0) + _on_hold(monkeypatch, t1)
    usual, base = [], Transport.exchange_now

    def the_usual_way(self, *args):
        usual.append(self.rank)
        return base(self, *args)

    monkeypatch.setattr(Transport, "exchange_now", the_usual_way)
    done: dict[int, tuple] = {}
    finished = []
    other = threading.Thread(target=lambda: done.__setitem__(1, _exchange(t1, 0, b"from1", 5)))
    other.start()
    role = t1._conns[0].role.lock
    deadline = time.monotonic() + 5
    while not role.locked() and time.monotonic() < deadline:
        time.sleep(0.001)
    done[0] = _exchange(t0, 1, b"from0", 5, finish=lambda: finished.append(0))
    other.join(10)
    for left, _ in done.values():
        _wait(t0, left)  # (rank 1's could be left to wait only if its send was queued)
    assert bytes(done[0][1]) == b"from1" and bytes(done[1][1]) == b"from0"
    assert finished == [0] and held == [] and 1 not in usual, usual


def test_an_exchange_answered_by_another_call_fails_with_mismatch(pair, monkeypatch):
    """The peer's frame is of another call (op 2): it is not taken; the usual path reads it
    and the receive fails with CollectiveMismatchError."""
    t0, t1 = pair
    ran = _while_reading(monkeypatch, t0, "taken", after=lambda: _wait(t1, [
        t1.isend(0, memoryview(b"abcd"), kind=int(Kind.COLL), group=0, tag=5, seq=2, fingerprint=0x99, dtype=2,
                 sync=True)]))
    left, _ = _exchange(t0, 1, b"mine", 4)
    assert ran == [1]
    assert left and isinstance(left[0].error, CollectiveMismatchError), left and left[0].error


def test_an_exchange_never_overtakes_a_queued_send(pair):
    """A large asynchronous send to the peer waits in the sender thread's queue (the peer
    reads nothing meanwhile: the test holds its read role): the exchange's frame goes
    behind it, the usual way, and its receive completes as well."""
    t0, t1 = pair
    big = bytes(range(256)) * (128 * 1024)  # 32 MiB: more than the sockets hold, so it stays queued
    first = t1.irecv(0, memoryview(bytearray(len(big))), kind=int(Kind.COLL), group=0, tag=5, dtype=2)
    role = t1._conns[0].role.lock
    assert role.acquire(timeout=5)
    try:
        queued = t0.isend(1, memoryview(big), kind=int(Kind.COLL), group=0, tag=5, seq=3, fingerprint=0x99, dtype=2)
        _wait(t1, [t1.isend(0, memoryview(b"back"), kind=int(Kind.COLL), group=0, tag=5, seq=3, fingerprint=0x99,
                            dtype=2, sync=True)])
        left, into = _exchange(t0, 1, b"tiny", 4)
        assert t0._conns[1].queue and any(not h.receive for h in left), left  # the send is queued behind
    finally:
        role.release()
    t1._conns[0].role.need()
    second = t1.irecv(0, memoryview(bytearray(4)), kind=int(Kind.COLL), group=0, tag=5, dtype=2)
    _wait(t0, [queued, *left], 30.0)
    _wait(t1, [first, second], 30.0)
    assert bytes(first.view) == big and bytes(second.view) == b"tiny" and bytes(into) == b"back"


@pytest.mark.parametrize(("setting", "local", "expected"), [
    (7.0, None, 7e-6),  # as set, wherever the ranks run
    (None, "1", "SPIN_US"),  # one rank here: it has a core of its own
    (None, "100000", 0.0),  # ranks outnumber the CPUs: a poller would take a waited-for rank's CPU
])
def test_how_long_a_waiting_rank_polls_its_socket(monkeypatch, setting, expected, local):
    from chorus.transport.tcp import SPIN_US, spin_seconds
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local) if local else monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    expected = SPIN_US * 1e-6 if expected == "SPIN_US" else expected
    with config.override(CHORUS_TCP_SPIN_US=setting):
        assert spin_seconds(world_size=2) == pytest.approx(expected)
