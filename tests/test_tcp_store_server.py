"""TCPStore and its server: workers, many concurrent clients, parked requests, hostile
clients, shutdown."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

import pytest
from proc_support import held_port
from store_support import TOKEN, tcp_client

from chorus import config, net
from chorus.errors import (
    AuthenticationError,
    ChorusError,
    InvalidArgumentError,
    RendezvousError,
    StoreTimeoutError,
)
from chorus.store import TCPStore, TCPStoreServer
from chorus.wire import store_codec as codec
from chorus.wire.handshake import ClientHandshake
from chorus.wire.store_codec import Op, Request, Response, Status


def test_tcp_store_master_reports_real_port_and_host():
    master = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=5, token=TOKEN)
    try:
        assert master.port > 0 and master.host == "127.0.0.1"
        client = TCPStore("127.0.0.1", master.port, timeout=5, token=TOKEN, use_libuv=True)
        client.set("from-client", b"1")
        assert master.get("from-client") == b"1"
        client.close()
    finally:
        master.close()


def test_tcp_store_waits_for_workers():
    port = held_port()
    clients = []

    def join_later():
        time.sleep(0.2)
        for _ in range(2):
            clients.append(TCPStore("127.0.0.1", port, timeout=5, token=TOKEN))

    t = threading.Thread(target=join_later)
    t.start()
    start = time.monotonic()
    master = TCPStore("127.0.0.1", port, world_size=3, is_master=True, timeout=5, token=TOKEN)
    elapsed = time.monotonic() - start
    t.join()
    assert 0.15 < elapsed < 4
    assert len(clients) == 2
    for c in clients:
        c.close()
    master.close()


def test_tcp_store_master_times_out_waiting_for_workers():
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="Timed out after .* waiting for 3 clients but only 1 connected"):
        TCPStore("127.0.0.1", 0, world_size=3, is_master=True, timeout=0.3, token=TOKEN)
    assert time.monotonic() - start < 3


def test_tcp_store_bad_ports():
    with pytest.raises(InvalidArgumentError, match="0..65535"):
        TCPStore("127.0.0.1", 70000, token=TOKEN)
    with pytest.raises(InvalidArgumentError, match="port 0 only works with is_master=True"):
        TCPStore("127.0.0.1", 0, token=TOKEN)


def test_tcp_store_address_in_use(server):
    with pytest.raises(RendezvousError, match=f"127.0.0.1:{server.port}.*--master-port 0"):
        TCPStore("127.0.0.1", server.port, is_master=True, timeout=1, token=TOKEN)


def test_multi_tenant_masters_share_one_server():
    port = held_port()
    a = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=5, token=TOKEN)
    b = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=5, token=TOKEN)
    a.set("shared", b"yes")
    assert b.get("shared") == b"yes"
    a.close()
    assert b.get("shared") == b"yes"  # the server lives while one tenant remains
    b.close()
    with net.listen("127.0.0.1", port):  # and is gone after the last
        pass


def test_sixteen_clients_hammering_add_get_an_exact_total(server):
    clients = [tcp_client(server) for _ in range(16)]
    per_thread = 150
    errors = []

    def hammer(c):
        try:
            for _ in range(per_thread):
                c.add("total", 1)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert clients[0].get("total") == str(16 * per_thread).encode()
    for c in clients:
        c.close()


def test_one_client_shared_by_threads(server):
    c = tcp_client(server)
    threads = [threading.Thread(target=lambda: [c.add("n", 2) for _ in range(100)])
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.add("n", 0) == 1600
    c.close()


def test_blocked_wait_is_woken_by_a_set_from_another_client(server):
    waiter, setter = tcp_client(server), tcp_client(server)
    done = []

    def wait():
        start = time.monotonic()
        waiter.wait(["a", "b"], timeout=10)
        done.append(time.monotonic() - start)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    setter.set("a", b"1")
    time.sleep(0.1)
    assert done == []  # still waiting for "b"
    setter.set("b", b"2")
    t.join(5)
    assert len(done) == 1 and 0.15 < done[0] < 3
    waiter.close()
    setter.close()


def test_parked_get_survives_delete_and_answers_with_the_final_value(server):
    a, b = tcp_client(server), tcp_client(server)
    result = []
    t = threading.Thread(target=lambda: result.append(a.multi_get(["p", "q"], timeout=5)))
    t.start()
    time.sleep(0.1)
    b.set("p", b"1")
    b.delete_key("p")
    b.set("q", b"2")
    time.sleep(0.1)
    assert result == []  # "p" is gone again, so the request is still parked
    b.set("p", b"3")
    t.join(5)
    assert result == [[b"3", b"2"]]
    a.close()
    b.close()


def test_many_parked_timeouts_are_answered_in_deadline_order(server):
    clients = [tcp_client(server) for _ in range(6)]
    finished = {}

    def wait(i, c):
        try:
            c.get(f"never-{i}", timeout=0.1 * (i + 1))
        except StoreTimeoutError as e:
            finished[i] = (time.monotonic(), str(e))

    threads = [threading.Thread(target=wait, args=(i, c)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert sorted(finished) == list(range(6))
    order = sorted(finished, key=lambda i: finished[i][0])
    assert order == list(range(6))
    assert f"never-{3}" in finished[3][1]
    for c in clients:
        c.close()


def _raw_handshaken_socket(port: int, token: bytes | None) -> socket.socket:
    sock = net.connect("127.0.0.1", port, timeout=5)
    net.client_handshake(sock, token, b"store", 5)
    return sock


def random_requests(n: int, seed: int = 99) -> list[Request]:
    """``n`` random non-blocking requests on keys under "junk/"."""
    rng = random.Random(seed)
    keys = [f"junk/{i}".encode() for i in range(20)]
    out = []
    for _ in range(n):
        k, v = rng.choice(keys), rng.randbytes(rng.randrange(0, 8))
        out.append(rng.choice([
            Request(Op.SET, (k, v)), Request(Op.ADD, (k,), rng.randrange(-5, 5)),
            Request(Op.COMPARE_SET, (k, v, b"x")), Request(Op.CHECK, (k, rng.choice(keys))),
            Request(Op.DELETE_KEY, (k,)), Request(Op.NUM_KEYS),
            Request(Op.MULTI_SET, (k, v, rng.choice(keys), v)),
            Request(Op.GET, (k,), 0), Request(Op.WAIT, (k,), 0),
        ]))
    return out


def _read_response(sock: socket.socket) -> Response:
    return codec.parse_response(net.recv_exact(sock, codec.parse_length(net.recv_exact(sock, 4))))


def test_server_survives_unauthenticated_and_garbage_clients(server):
    good = tcp_client(server)
    stop = threading.Event()
    failures = []
    rounds = [0]

    def well_behaved():
        i = 0
        try:
            while not stop.is_set():
                good.set(f"key{i}", str(i))
                assert good.get(f"key{i}") == str(i).encode()
                assert good.add("count", 1) == i + 1
                i += 1
        except Exception as e:
            failures.append(e)
        rounds[0] = i

    t = threading.Thread(target=well_behaved)
    t.start()
    try:
        # 1. a client without the token is refused
        with pytest.raises(AuthenticationError):
            TCPStore("127.0.0.1", server.port, timeout=2, token=None)
        # 2. raw garbage before any handshake
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            raw.settimeout(5)
            assert raw.recv(100) == b""  # closed by the server
        # 3. a client that sends 10,000 random well-formed requests gets 10,000 answers
        sock = _raw_handshaken_socket(server.port, TOKEN)
        with sock:
            sock.sendall(b"".join(codec.pack_request(r) for r in random_requests(10_000)))
            sock.settimeout(10)
            statuses = [_read_response(sock).status for _ in range(10_000)]
            assert set(statuses) == {Status.OK, Status.ERROR, Status.TIMEOUT}
            assert statuses.count(Status.OK) > 5000
        # 4. a client that sends 10,000 frames of random bytes is dropped
        rng = random.Random(1234)
        frames = []
        for _ in range(10_000):
            body = rng.randbytes(rng.randrange(0, 40))
            frames.append(struct.pack("!I", len(body)) + body)
        sock = _raw_handshaken_socket(server.port, TOKEN)
        with sock:
            try:
                sock.sendall(b"".join(frames))
            except OSError:
                pass  # the server may already have closed it
            sock.settimeout(5)
            try:
                while sock.recv(65536):
                    pass
            except ConnectionResetError:
                pass
        # 5. a client that connects and says nothing does not block anyone
        with socket.create_connection(("127.0.0.1", server.port)):
            time.sleep(0.3)
    finally:
        stop.set()
        t.join(10)
    assert failures == []
    assert rounds[0] > 10
    assert good.get("count") == str(rounds[0]).encode()
    good.close()


def test_server_drops_a_client_with_an_oversized_frame_and_keeps_serving(server):
    sock = _raw_handshaken_socket(server.port, TOKEN)
    with sock:
        sock.sendall(struct.pack("!I", 0xFFFFFFFF))
        sock.settimeout(5)
        assert sock.recv(10) == b""
    c = tcp_client(server)
    c.set("still", b"fine")
    assert c.get("still") == b"fine"
    c.close()


def test_pipelined_requests_are_answered_in_order(server):
    sock = _raw_handshaken_socket(server.port, TOKEN)
    with sock:
        sock.sendall(codec.pack_request(Request(Op.GET, (b"later",), 5000))
                     + codec.pack_request(Request(Op.ADD, (b"n",), 4)))
        time.sleep(0.1)
        c = tcp_client(server)
        assert c.add("n", 0) == 0  # the ADD waits behind the parked GET
        c.set("later", b"now")
        first, second = _read_response(sock), _read_response(sock)
        assert first == Response(Status.OK, (b"now",))
        assert second == Response(Status.OK, (), 4)
        c.close()


def test_first_request_may_arrive_with_the_proof(server):
    sock = net.connect("127.0.0.1", server.port, timeout=5)
    with sock:
        client = ClientHandshake(TOKEN, b"store")
        sock.sendall(client.initial_bytes())
        proof = b""
        while not client.done:
            proof = client.receive(net.recv_exact(sock, client.bytes_needed()))
        sock.sendall(proof + codec.pack_request(Request(Op.ADD, (b"together",), 3)))
        assert _read_response(sock) == Response(Status.OK, (), 3)


def test_client_reports_a_lost_server():
    srv = TCPStoreServer("127.0.0.1", 0, token=TOKEN)
    c = tcp_client(srv)
    c.set("x", b"1")
    srv.close()
    with pytest.raises(RendezvousError, match="lost the connection to the store"):
        c.get("x")
    with pytest.raises(ChorusError, match="closed or lost its connection"):
        c.get("x")
    c.close()


def test_close_stops_the_server_thread_and_frees_the_port():
    srv = TCPStoreServer("127.0.0.1", 0, token=TOKEN)
    port = srv.port
    c = tcp_client(srv)
    names = [t.name for t in threading.enumerate()]
    assert f"chorus-store-server:{port}" in names
    srv.close()
    srv.close()  # idempotent
    assert f"chorus-store-server:{port}" not in [t.name for t in threading.enumerate()]
    with net.listen("127.0.0.1", port):
        pass
    c.close()


def test_close_wakes_a_blocked_get():
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30, token=TOKEN)
    client = tcp_client(master, timeout=30)
    errors = []
    t = threading.Thread(target=lambda: errors.append(_catch(client.get, "never")))
    t.start()
    time.sleep(0.1)
    start = time.monotonic()
    client.close()
    t.join(5)
    assert time.monotonic() - start < 3
    assert isinstance(errors[0], ChorusError) and "closed" in str(errors[0])
    master.close()


def _catch(fn, *args):
    try:
        fn(*args)
    except Exception as e:
        return e
    return None


def test_token_from_environment(monkeypatch):
    monkeypatch.setenv("CHORUS_TOKEN", "env-token")
    srv = TCPStoreServer("127.0.0.1", 0)
    try:
        c = TCPStore("127.0.0.1", srv.port, timeout=5)
        c.set("a", b"1")
        c.close()
        with pytest.raises(AuthenticationError):
            TCPStore("127.0.0.1", srv.port, timeout=5, token="other")
    finally:
        srv.close()


# -- file store ------------------------------------------------------------------------


def test_a_client_without_the_token_gets_a_clear_error_for_an_oversized_value(monkeypatch):
    """Tokenless store: values over CHORUS_STORE_MAX_VALUE_BYTES and writes that would grow
    the store over CHORUS_STORE_MAX_BYTES are refused with an error naming the limit; a
    request far over the limit is dropped unread, and the connection goes on."""
    monkeypatch.delenv("CHORUS_TOKEN", raising=False)
    with config.override(CHORUS_STORE_MAX_VALUE_BYTES=1024, CHORUS_STORE_MAX_BYTES=8192):
        srv = TCPStoreServer("127.0.0.1", 0)
    c = TCPStore("127.0.0.1", srv.port, timeout=5)
    try:
        c.set("small", bytes(1000))
        with pytest.raises(InvalidArgumentError, match=r"a value of 2048 bytes.*at most 1024 bytes "
                                                       r"\(CHORUS_STORE_MAX_VALUE_BYTES\).*CHORUS_TOKEN"):
            c.set("big", bytes(2048))
        with pytest.raises(InvalidArgumentError, match=r"a request of \d+ bytes.*CHORUS_STORE_MAX_VALUE_BYTES"):
            c.set("huge", bytes(64 << 20))
        with pytest.raises(InvalidArgumentError, match="a value of 2000 bytes"):
            c.compare_set("small", bytes(1000), bytes(2000))
        stored = 1
        with pytest.raises(InvalidArgumentError, match=r"beyond 8192 bytes \(CHORUS_STORE_MAX_BYTES\)"):
            for i in range(10):
                c.set(f"k{i}", bytes(1000))
                stored += 1
        assert stored == 8 and c.get("small") == bytes(1000) and not c.check(["big", "huge"])
        c.delete_key("k0")
        c.set("k0", bytes(1000))  # room again
    finally:
        c.close()
        srv.close()


def test_a_client_with_the_token_is_not_limited():
    with config.override(CHORUS_STORE_MAX_VALUE_BYTES=1024):
        srv = TCPStoreServer("127.0.0.1", 0, token=TOKEN)
    c = tcp_client(srv)
    try:
        c.set("big", bytes(4 << 20))
        assert len(c.get("big")) == 4 << 20
    finally:
        c.close()
        srv.close()
