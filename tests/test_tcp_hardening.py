"""The TCP transport under hostile or broken peers: every wait
is bounded, and floods are survived.

Ranks are TcpTransports in threads of this process over a HashStore; a *fake* rank is a
raw socket that authenticates (it knows the token) and says HELLO like a rank, then does
what a real rank never does: claims absurd payload sizes, or stops reading.  Only the
out-of-descriptors test needs a process of its own (a lowered open-file limit)."""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc

import numpy as np
import pytest

from chorus import config, net
from chorus.errors import BufferMismatchError, CommTimeoutError, PeerLostError
from chorus.store import HashStore, TCPStore, TCPStoreServer
from chorus.transport import shm_link
from chorus.transport.ring import RingReader, RingWriter, ring_size
from chorus.transport.tcp import TcpTransport
from chorus.wire.frames import MAX_PAYLOAD, Kind, control_header, pack_fields
from chorus.wire.handshake import ClientHandshake

TOKEN = b"hardening-test-token"
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _sockets_only():
    """No shared-memory rings: payloads ride the sockets (and fake ranks need none)."""
    with config.override(CHORUS_SHM_P2P=False):
        yield


def _fake_connect(store, rank: int, world: int, peer: int) -> socket.socket:
    """Rank ``rank``'s connection to real rank ``peer`` (< rank), made by hand: token
    handshake, HELLO with the job's session, no rings."""
    session = int(store.get("tcp/session"))
    host, port = store.get(f"tcp/addr/{peer}").decode().rsplit(":", 1)
    sock = net.connect(host, int(port), 5.0)
    net.client_handshake(sock, TOKEN, b"transport", 5.0)
    sock.sendall(control_header(Kind.HELLO, tag=rank, group=world) + session.to_bytes(8, "little"))
    assert shm_link.connector_side(sock, rank, world) is None
    return sock


class Job:
    """``real`` TcpTransports (ranks 0..real-1) and fake ranks above them."""

    def __init__(self, real: int, fake: int, timeout: float = 10.0):
        self.world = real + fake
        self.store = HashStore()
        self.ranks: dict[int, TcpTransport] = {}
        errors = []

        def start(rank):
            try:
                self.ranks[rank] = TcpTransport(rank, self.world, self.store, token=TOKEN, timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(r,)) for r in range(real)]
        for t in threads:
            t.start()
        self.fakes = {rank: {peer: _fake_connect(self.store, rank, self.world, peer) for peer in range(real)}
                      for rank in range(real, self.world)}
        for t in threads:
            t.join(timeout + 5)
        assert not errors and len(self.ranks) == real, errors

    def close(self):
        """Fake ranks read everything first (a send stuck on them then finishes), then
        everything closes."""
        for socks in self.fakes.values():
            for s in socks.values():
                threading.Thread(target=_drain, args=(s,), daemon=True).start()
        for t in self.ranks.values():
            t.close()
        for socks in self.fakes.values():
            for s in socks.values():
                s.close()


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(1 << 20):
            pass
    except OSError:
        pass


@pytest.fixture
def jobs():
    made = []
    yield lambda *a, **k: made.append(Job(*a, **k)) or made[-1]
    for job in made:
        job.close()


def _recv(t: TcpTransport, peer: int, tag: int, nbytes: int = 64):
    return t.irecv(peer, memoryview(bytearray(nbytes)), kind=Kind.DATA, group=0, tag=tag)


def _outcome(t: TcpTransport, handle, deadline: float):
    """(the error the handle failed with, seconds until it did)."""
    start = time.monotonic()
    try:
        t.wait_all([handle], deadline, lambda: "test receive")
    except Exception as exc:  # noqa: BLE001 - returned
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


# -- a crafted length from an authenticated peer -------------------------------------------------

@pytest.mark.parametrize("posted", [False, True], ids=["unposted", "posted"])
@pytest.mark.parametrize("claim", [2**34, 2**47, 2**60])
def test_a_crafted_length_fails_every_rank_within_5s_and_allocates_nothing(jobs, claim, posted):
    """Fake rank 2 sends rank 0 a header claiming ``claim`` bytes (and nothing after it),
    either for a 64-byte receive rank 0 posted or for none.  Ranks 0 and 1 each wait on
    another receive from rank 2: both fail with PeerLostError within 5 s, rank 0's naming
    the claim and the limit, and nothing anywhere tried to allocate the claim."""
    limit = 1 << 30
    with config.override(CHORUS_MAX_MESSAGE_BYTES=limit):
        job = jobs(2, 1)
    t0, t1 = job.ranks[0], job.ranks[1]
    pending = [_recv(t0, 2, tag=6), _recv(t1, 2, tag=6)]
    target = _recv(t0, 2, tag=5) if posted else None
    tracemalloc.start()
    try:
        sent_at = time.monotonic()
        job.fakes[2][0].sendall(pack_fields(int(Kind.DATA), 0, 5, 0, claim, 0, 0))
        outcomes = [_outcome(t, h, sent_at + 6.0) for t, h in zip((t0, t1), pending, strict=True)]
        took = time.monotonic() - sent_at
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all(isinstance(error, PeerLostError) for error, _ in outcomes) and took < 5.0, (outcomes, took)
    message = str(outcomes[0][0])
    shown_limit = MAX_PAYLOAD if claim > MAX_PAYLOAD else limit
    assert str(claim) in message and str(shown_limit) in message, message
    assert "rank 2" in str(outcomes[1][0]), outcomes[1]
    assert peak < 64 * MIB, f"{peak} bytes were allocated (or tried) while the claim was read"
    if posted:  # the receive the frame matched fails at once (unless the header itself is invalid)
        assert isinstance(target.error, BufferMismatchError if claim <= MAX_PAYLOAD else PeerLostError)


def test_a_claim_beyond_physical_memory_is_refused_with_the_default_limit(jobs):
    """The issue's 2**47 (it killed the reader with a numpy allocation error): with no
    setting the limit is this host's memory."""
    job = jobs(2, 1)
    t0, t1 = job.ranks[0], job.ranks[1]
    pending = [_recv(t0, 2, tag=6), _recv(t1, 2, tag=6)]
    job.fakes[2][0].sendall(pack_fields(int(Kind.COLL), 0, 5, 1, 2**47, 0, 0))
    deadline = time.monotonic() + 5.0
    (e0, _), (e1, _) = (_outcome(t, h, deadline) for t, h in zip((t0, t1), pending, strict=True))
    assert isinstance(e0, PeerLostError) and str(2**47) in str(e0) and "physical memory" in str(e0), e0
    assert isinstance(e1, PeerLostError), e1


def test_a_peer_that_stalls_half_way_through_a_payload_is_declared_lost(jobs):
    """Rank 0 reads half of a 1 MiB payload, then nothing comes: with a heartbeat timeout
    of 1 s it gives the peer up within a few seconds, not at the op deadline (60 s)."""
    with config.override(CHORUS_HEARTBEAT_TIMEOUT=1):
        job = jobs(1, 1)
    t0 = job.ranks[0]
    h = _recv(t0, 1, tag=5, nbytes=MIB)
    job.fakes[1][0].sendall(pack_fields(int(Kind.DATA), 0, 5, 0, MIB, 0, 0) + bytes(MIB // 2))
    error, waited = _outcome(t0, h, time.monotonic() + 60.0)
    assert isinstance(error, PeerLostError) and "stopped answering" in str(error), error
    assert waited < 4.0, waited


def test_a_reader_that_fails_fails_every_waiter_and_tells_the_other_ranks(jobs):
    """A receive into a read-only buffer makes rank 0's reader raise TypeError: that
    receive, rank 0's other waiter and rank 1's waiter all fail at once, naming it."""
    job = jobs(2, 1)
    t0, t1 = job.ranks[0], job.ranks[1]
    readonly = t0.irecv(2, memoryview(bytes(64)), kind=Kind.DATA, group=0, tag=5)
    pending = [_recv(t0, 2, tag=6), _recv(t1, 2, tag=6)]
    job.fakes[2][0].sendall(pack_fields(int(Kind.DATA), 0, 5, 0, 64, 0, 0) + bytes(64))
    deadline = time.monotonic() + 5.0
    errors = [_outcome(t, h, deadline)[0] for t, h in ((t0, readonly), (t0, pending[0]), (t1, pending[1]))]
    assert all(isinstance(e, PeerLostError) for e in errors), errors
    assert all("TypeError" in str(e) for e in errors[:2]), errors
    assert "rank 2 could not be read from any more" in str(errors[2]), errors[2]


# -- a peer that stops reading -----------------------------------------------------------------

def _blocked_send(t: TcpTransport, nbytes: int = 32 * MIB):
    """A synchronous send to fake rank 1, which never reads: (handle, seconds isend took)."""
    start = time.monotonic()
    h = t.isend(1, memoryview(np.zeros(nbytes, np.uint8)), kind=Kind.DATA, group=0, tag=1, sync=True)
    return h, time.monotonic() - start


def _in_thread(fn, limit: float):
    """Run ``fn`` in a thread; its result, or a failure if it is still blocked at ``limit``."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"still blocked after {limit} s"
    return out[0]


def test_a_send_to_a_peer_that_stops_reading_ends_by_the_op_deadline(jobs):
    job = jobs(1, 1)
    t0 = job.ranks[0]

    def run():
        h, took = _blocked_send(t0)
        error, waited = _outcome(t0, h, time.monotonic() + 1.0)
        return took, error, waited

    took, error, waited = _in_thread(run, 5.0)
    assert took < 0.5, f"isend held the caller for {took:.2f} s"
    assert isinstance(error, CommTimeoutError) and waited < 1.5, (error, waited)


def test_a_send_to_a_peer_that_stops_reading_ends_when_it_is_declared_lost(jobs):
    """Op deadline 60 s, heartbeat timeout 1 s: the send fails once the silent peer is
    declared lost (shutting its socket down wakes the sender), not at the deadline."""
    with config.override(CHORUS_HEARTBEAT_TIMEOUT=1):
        job = jobs(1, 1)
    t0 = job.ranks[0]

    def run():
        h, _ = _blocked_send(t0)
        return _outcome(t0, h, time.monotonic() + 60.0)

    error, waited = _in_thread(run, 6.0)
    assert isinstance(error, PeerLostError) and "stopped answering" in str(error), error
    assert waited < 4.0, waited


def test_a_ring_write_stops_when_the_ring_stays_full_and_goes_on_from_there():
    size = 64 << 10
    buf = bytearray(ring_size(size))
    writer = RingWriter(buf, 0, size, bell=lambda: None, piece=16 << 10, yield_s=1e-5)
    data = memoryview(np.arange(4 * size, dtype=np.uint8))
    announced = []
    done = writer.write(data, lambda: announced.append(1), 0, 0.05)
    assert 0 < done <= size and announced == [1]  # the ring is full: nobody reads it
    assert writer.write(data, lambda: announced.append(2), done, 0.05) == done
    reader = RingReader(buf, 0, size, doze=lambda s: False, peer=1, piece=16 << 10, yield_s=1e-5)
    out = np.zeros(len(data), np.uint8)
    t = threading.Thread(target=reader.read_into, args=(memoryview(out),))
    t.start()
    assert writer.write(data, lambda: announced.append(3), done) == len(data)
    t.join(10)
    assert announced == [1] and np.array_equal(out, np.asarray(data))


# -- floods ------------------------------------------------------------------------------------

def _admit_threads() -> int:
    return sum(t.name.startswith("chorus-admit-") for t in threading.enumerate())


class _CountingPending(net.Pending):
    """net.Pending that keeps the most connections it held at once."""

    most = 0

    def add(self, key: object) -> None:
        super().add(key)
        _CountingPending.most = max(_CountingPending.most, len(self))


def test_a_slow_loris_is_cut_off_at_the_handshake_deadline_and_the_job_still_sets_up(monkeypatch):
    """12 connections send a valid handshake 1 byte per 0.2 s; at most 4 are handshaken
    at once and each is closed 0.5 s after it was accepted — so all are closed within
    about 3 x 0.5 s — while rank 1 connects among them and the job sets up."""
    monkeypatch.setattr(net, "Pending", _CountingPending)
    _CountingPending.most = 0
    overrides = dict(CHORUS_HANDSHAKE_TIMEOUT=0.5, CHORUS_MAX_PENDING_CONNECTIONS=4)
    store, ranks = HashStore(), {}
    with config.override(**overrides):
        r0 = threading.Thread(target=lambda: ranks.setdefault(0, TcpTransport(0, 2, store, token=TOKEN, timeout=10)))
        r0.start()
        host, port = store.get("tcp/addr/0").decode().rsplit(":", 1)
        hello = ClientHandshake(TOKEN, b"transport").initial_bytes()
        start = time.monotonic()
        loris = [socket.create_connection((host, int(port))) for _ in range(12)]
        r1 = threading.Thread(target=lambda: ranks.setdefault(1, TcpTransport(1, 2, store, token=TOKEN, timeout=10)))
        r1.start()
        sel = selectors.DefaultSelector()
        for s in loris:
            sel.register(s, selectors.EVENT_READ)
        closed_at, sent = {}, 0
        try:
            while len(closed_at) < len(loris) and time.monotonic() - start < 6.0:
                for key, _ in sel.select(0.2):  # readable: EOF, the server closed it
                    sel.unregister(key.fileobj)
                    closed_at[key.fileobj] = time.monotonic() - start
                if sent < len(hello) - 1:
                    for s in loris:
                        if s not in closed_at:
                            try:
                                s.send(hello[sent:sent + 1])
                            except OSError:
                                pass
                    sent += 1
            r0.join(10)
            r1.join(10)
        finally:
            for s in loris:
                s.close()
    assert len(closed_at) == len(loris), f"{len(loris) - len(closed_at)} slow connections still open after 6 s"
    assert max(closed_at.values()) < 3.0, sorted(closed_at.values())
    assert 1 <= _CountingPending.most <= 4, _CountingPending.most  # (a thread count would include ending ones)
    assert set(ranks) == {0, 1}, "the job did not set up during the slow-loris"
    for t in ranks.values():
        t.close()
    end = time.monotonic() + 1.0
    while _admit_threads() and time.monotonic() < end:
        time.sleep(0.01)
    assert not _admit_threads(), "a handshake thread outlived its deadline"


def test_pending_connections_shed_the_oldest_unopened_one_and_never_an_opened_one(monkeypatch):
    monkeypatch.setattr(net, "SHED_AFTER_S", 0.05)
    pending = net.Pending(2)
    pending.add("rank")
    pending.opened("rank")  # sent its opening message: never shed
    pending.add("idle")
    room, victim, wait = pending.room()
    assert (room, victim) == (False, None) and 0 < wait <= 0.05  # "idle" is too young to shed yet
    time.sleep(0.06)
    assert pending.room() == (True, "idle", 0.0) and pending.was_shed("idle") and pending.shed == 1
    assert pending.room() == (True, None, 0.0)  # room left by the shed one
    pending.add("late")
    pending.remove("rank")
    assert pending.room() == (True, None, 0.0)


def _flood(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` connections that connect and send nothing (non-blocking: the backlog may be full)."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, port))
        out.append(s)
    return out


def test_a_flood_of_idle_connections_is_shed_and_a_rank_behind_it_joins_within_seconds():
    """96 idle connections reach rank 0's transport before rank 1 does; with 16 handshake
    slots they would hold rank 1 back for 96 / 16 x 10 s; shed a quarter-second after
    they were accepted, for about 96 / 16 x 0.25 s."""
    store, ranks = HashStore(), {}
    with config.override(CHORUS_MAX_PENDING_CONNECTIONS=16):
        r0 = threading.Thread(target=lambda: ranks.setdefault(0, TcpTransport(0, 2, store, token=TOKEN, timeout=60)))
        r0.start()
        host, port = store.get("tcp/addr/0").decode().rsplit(":", 1)
        flood = _flood(host, int(port), 96)
        start = time.monotonic()
        try:
            ranks[1] = TcpTransport(1, 2, store, token=TOKEN, timeout=60)
            joined = time.monotonic() - start
            r0.join(10)
        finally:
            for s in flood:
                s.close()
    for t in ranks.values():
        t.close()
    assert set(ranks) == {0, 1} and joined < 8.0, joined


def test_the_store_server_sheds_a_flood_of_idle_connections_and_keeps_its_descriptors():
    """The same against a store server: a client behind 96 idle connections is served
    within seconds, and the server holds at most its 16 slots' worth of them."""
    before = len(os.listdir("/proc/self/fd"))
    with config.override(CHORUS_MAX_PENDING_CONNECTIONS=16):
        server = TCPStoreServer("127.0.0.1", 0, token=TOKEN)
    flood = _flood("127.0.0.1", server.port, 96)
    try:
        start = time.monotonic()
        client = TCPStore("127.0.0.1", server.port, timeout=60, token=TOKEN)
        client.set("k", b"v")
        assert client.get("k") == b"v"
        joined = time.monotonic() - start
        held = len(os.listdir("/proc/self/fd")) - before - len(flood)
        client.close()
    finally:
        for s in flood:
            s.close()
        server.close()
    assert joined < 8.0, joined
    assert held <= 16 + 6, held  # the slots, the listener, the loop's wake pair, the client and its peer


_STARVE = textwrap.dedent("""
    import logging, os, resource, sys, threading

    starved = threading.Event()

    class Watch(logging.Handler):
        def emit(self, record):
            if "out of file descriptors" in record.getMessage():
                starved.set()

    logging.getLogger("chorus").addHandler(Watch())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))

    def flood_then_go(address):
        hoard = []  # every descriptor left: the next accept has none
        while True:
            try:
                hoard.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        print(address, flush=True)  # the test floods it ...
        print("starved" if starved.wait(10) else "never starved", flush=True)
        for fd in hoard:
            os.close(fd)
        sys.stdin.readline()  # ... and the flood is gone
""")

_TRANSPORT_AFTER_STARVING = _STARVE + textwrap.dedent("""
    import numpy as np
    from chorus.store import HashStore, TCPStore, TCPStoreServer
    from chorus.transport.tcp import TcpTransport
    from chorus.wire.frames import Kind

    store, ranks = HashStore(), {}
    # (generous timeouts: what counts is that the rank joins at all, also on a busy machine)
    r0 = threading.Thread(target=lambda: ranks.setdefault(0, TcpTransport(0, 2, store, token=b"t", timeout=60)))
    r0.start()
    flood_then_go(store.get("tcp/addr/0").decode())
    ranks[1] = TcpTransport(1, 2, store, token=b"t", timeout=60)
    r0.join(60)
    out = np.zeros(4, np.int64)
    h = ranks[0].irecv(1, memoryview(out).cast("B"), kind=Kind.DATA, group=0, tag=3)
    ranks[1].isend(0, memoryview(np.arange(4, dtype=np.int64)).cast("B"), kind=Kind.DATA, group=0, tag=3)
    h.wait(None)
    print("ok" if h.error is None and out.tolist() == [0, 1, 2, 3] else f"wrong: {h.error} {out}", flush=True)
""")

_STORE_AFTER_STARVING = _STARVE + textwrap.dedent("""
    from chorus.store import TCPStore, TCPStoreServer

    server = TCPStoreServer("127.0.0.1", 0, token=b"t")
    flood_then_go(f"127.0.0.1:{server.port}")
    client = TCPStore("127.0.0.1", server.port, timeout=60, token=b"t")
    client.set("k", b"v")
    print("ok" if client.get("k") == b"v" else "wrong", flush=True)
""")


@pytest.mark.parametrize("script", [_TRANSPORT_AFTER_STARVING, _STORE_AFTER_STARVING], ids=["transport", "store"])
def test_accepting_survives_running_out_of_descriptors(tmp_path, script):
    """Open-file limit 64, all of them taken, 20 connections from this process: the
    accept loop runs out of descriptors, says so, keeps accepting, and once descriptors
    are free again a rank (a store client) joins."""
    path = tmp_path / "starve.py"
    path.write_text(script)
    env = dict(os.environ, CHORUS_MAX_PENDING_CONNECTIONS="1000", CHORUS_SHM_P2P="0",
               CHORUS_HANDSHAKE_TIMEOUT="30")
    proc = subprocess.Popen([sys.executable, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    flood = []
    try:
        host, port = proc.stdout.readline().strip().rsplit(":", 1)
        flood = [socket.create_connection((host, int(port))) for _ in range(20)]
        assert proc.stdout.readline().strip() == "starved"
        for s in flood:
            s.close()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        result = proc.stdout.readline().strip()
        _, err = proc.communicate(timeout=60)
    finally:
        for s in flood:
            s.close()
        proc.kill()
    assert result == "ok", err[-3000:]
