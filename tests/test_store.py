"""Stores: every op on every store type, timeouts, concurrency, and a hostile network."""

from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from chorus import net
from chorus.errors import (
    AuthenticationError,
    ChorusError,
    InvalidArgumentError,
    ProtocolError,
    RendezvousError,
    StoreTimeoutError,
)
from chorus.store import FileStore, HashStore, PrefixStore, Store, TCPStore, TCPStoreServer
from chorus.wire import store_codec as codec
from chorus.wire.handshake import ClientHandshake
from chorus.wire.store_codec import Op, Request, RequestParser, Response, Status

TOKEN = b"test-token"


@pytest.fixture
def server():
    srv = TCPStoreServer("127.0.0.1", 0, token=TOKEN)
    yield srv
    srv.close()


def tcp_client(server, timeout=5.0) -> TCPStore:
    return TCPStore("127.0.0.1", server.port, timeout=timeout, token=TOKEN)


@pytest.fixture(params=["hash", "file", "tcp", "prefix-hash", "prefix-file", "prefix-tcp"])
def store(request, tmp_path):
    """One store of each kind, with a 5 s default timeout."""
    kind = request.param
    closers = []
    base_kind = kind.removeprefix("prefix-")
    if base_kind == "hash":
        base = HashStore(timeout=5)
    elif base_kind == "file":
        base = FileStore(str(tmp_path / "store"), timeout=5)
    else:
        base = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=5, token=TOKEN)
    closers.append(base.close)
    yield PrefixStore("pre", base) if kind.startswith("prefix") else base
    for close in closers:
        close()


def full(store: Store, key: str) -> str:
    """The key as the underlying store names it in errors."""
    return f"pre/{key}" if isinstance(store, PrefixStore) else key


# -- every op on every store -----------------------------------------------------------

def test_set_get_bytes_and_str(store):
    store.set("k", b"\x00\xffraw")
    store.set("s", "héllo")
    assert store.get("k") == b"\x00\xffraw"
    assert store.get("s") == "héllo".encode()
    store.set("k", b"new")
    assert store.get("k") == b"new"
    store.set("empty", b"")
    assert store.get("empty") == b""


def test_get_times_out_naming_key_and_timeout(store):
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        store.get("missing-key", timeout=timedelta(milliseconds=200))
    assert 0.15 < time.monotonic() - start < 3
    assert repr(full(store, "missing-key")) in str(info.value)
    assert "0.2s" in str(info.value)
    assert isinstance(info.value, TimeoutError)


def test_store_timeout_is_the_default_and_settable(store):
    assert store.timeout == timedelta(seconds=5)
    store.set_timeout(0.15)
    assert store.timeout == timedelta(seconds=0.15)
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError, match="0.15s"):
        store.get("never")
    assert 0.1 < time.monotonic() - start < 3
    with pytest.raises(StoreTimeoutError) as info:
        store.wait(["a", "b"])
    assert f"{full(store, 'a')!r}, {full(store, 'b')!r}" in str(info.value)


def test_add(store):
    assert store.add("counter", 5) == 5
    assert store.add("counter", -7) == -2
    assert store.get("counter") == b"-2"
    store.set("text", "not a number")
    with pytest.raises(InvalidArgumentError, match="not an integer counter"):
        store.add("text", 1)
    assert store.get("text") == b"not a number"


def test_compare_set_has_torch_semantics(store):
    # missing key, expected empty: set
    assert store.compare_set("cas", "", "first") == b"first"
    # matching: set
    assert store.compare_set("cas", "first", b"second") == b"second"
    # not matching: unchanged, current value returned
    assert store.compare_set("cas", "wrong", "third") == b"second"
    assert store.get("cas") == b"second"
    # missing key, non-empty expected: unchanged, expected returned
    assert store.compare_set("absent", "exp", "des") == b"exp"
    assert not store.check(["absent"])


def test_wait_check_delete_num_keys(store):
    base = store.num_keys()
    store.set("a", "1")
    store.set("b", "2")
    store.wait(["a", "b"])
    store.wait(["a"], timeout=0.1)
    store.wait([])
    assert store.check(["a", "b"]) is True
    assert store.check(["a", "c"]) is False
    assert store.num_keys() == base + 2
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.check(["a"]) is False
    assert store.num_keys() == base + 1
    with pytest.raises(StoreTimeoutError) as info:
        store.wait(["a", "b", "zz"], timeout=0.1)
    assert repr(full(store, "a")) in str(info.value)
    assert repr(full(store, "zz")) in str(info.value)
    assert repr(full(store, "b")) not in str(info.value)


def test_multi_get_multi_set(store):
    store.multi_set(["x", "y", "z"], [b"1", "2", b"3"])
    assert store.multi_get(["z", "x"]) == [b"3", b"1"]
    assert store.get("y") == b"2"
    assert store.multi_get([]) == []
    with pytest.raises(InvalidArgumentError, match="2 keys but 1 values"):
        store.multi_set(["p", "q"], [b"1"])
    with pytest.raises(StoreTimeoutError) as info:
        store.multi_get(["x", "nope"], timeout=0.1)
    assert repr(full(store, "nope")) in str(info.value)
    assert repr(full(store, "x")) not in str(info.value)


def test_bad_keys_values_and_timeouts(store):
    with pytest.raises(InvalidArgumentError, match="keys must be str, got int"):
        store.set(3, b"v")
    with pytest.raises(InvalidArgumentError, match="values must be bytes or str, got int"):
        store.set("k", 3)
    with pytest.raises(InvalidArgumentError, match="zero or more seconds, got -1"):
        store.get("k", timeout=-1)
    with pytest.raises(InvalidArgumentError, match="zero or more seconds, got nan"):
        store.wait(["k"], timeout=float("nan"))
    with pytest.raises(InvalidArgumentError, match="timedelta or seconds, got str"):
        store.set_timeout("10")


def second_handle(store: Store) -> tuple[Store, Store]:
    """Return (another handle on ``store``'s data, the base store to close or None)."""
    prefixed = isinstance(store, PrefixStore)
    inner = store.underlying_store if prefixed else store
    if isinstance(inner, TCPStore):
        other = TCPStore("127.0.0.1", inner.port, timeout=5, token=TOKEN)
    elif isinstance(inner, FileStore):
        other = FileStore(inner.path, timeout=5)
    else:
        return store, None  # a HashStore is shared by its threads
    return (PrefixStore("pre", other) if prefixed else other), other


def test_get_wakes_when_another_thread_sets(store):
    other, to_close = second_handle(store)
    timer = threading.Timer(0.2, other.set, args=("late", b"value"))
    timer.start()
    start = time.monotonic()
    assert store.get("late", timeout=5) == b"value"
    assert 0.15 < time.monotonic() - start < 2
    timer.join()
    assert other.get("late") == b"value"
    if to_close is not None:
        to_close.close()


def test_huge_timeouts_are_accepted(store):
    other, to_close = second_handle(store)
    store.set_timeout(timedelta(days=36500))
    assert store.timeout == timedelta(days=36500)
    timer = threading.Timer(0.1, other.set, args=("slow", b"1"))
    timer.start()
    assert store.get("slow") == b"1"
    timer.join()
    timer = threading.Timer(0.1, other.set, args=("slower", b"2"))
    timer.start()
    assert store.multi_get(["slower"], timeout=float("inf")) == [b"2"]
    timer.join()
    if to_close is not None:
        to_close.close()


def test_zero_timeout_checks_without_waiting(store):
    store.set("here", b"1")
    assert store.get("here", timeout=0) == b"1"
    with pytest.raises(StoreTimeoutError):
        store.get("not-here", timeout=0)


# -- prefix store ----------------------------------------------------------------------

def test_prefix_store_namespaces_keys():
    base = HashStore()
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    a.set("k", b"1")
    b.set("k", b"2")
    assert base.get("a/k") == b"1" and base.get("b/k") == b"2"
    nested = PrefixStore("n", a)
    nested.set("deep", b"3")
    assert base.get("a/n/deep") == b"3"
    assert nested.underlying_store is a
    with pytest.raises(InvalidArgumentError, match="needs a chorus Store"):
        PrefixStore("p", {})


# -- TCP store: server behaviour ------------------------------------------------------

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
    with net.listen("127.0.0.1", 0) as probe:
        port = probe.getsockname()[1]
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
    with pytest.raises(StoreTimeoutError, match="for 3 clients but only 1 connected"):
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
    with net.listen("127.0.0.1", 0) as probe:
        port = probe.getsockname()[1]
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

def test_file_store_across_processes(tmp_path):
    path = str(tmp_path / "shared")
    code = (
        "import sys; from chorus.store.file_store import FileStore\n"
        "s = FileStore(sys.argv[1], timeout=20)\n"
        "v = s.get('ping')\n"
        "s.set('pong', v + b'!')\n"
        "for _ in range(100): s.add('n', 1)\n"
        "s.close()\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", code, path], env=env)
    store = FileStore(path, timeout=20)
    store.set("ping", b"hi")
    for _ in range(100):
        store.add("n", 1)
    assert store.get("pong") == b"hi!"
    assert child.wait(30) == 0
    assert store.get("n") == b"200"
    store.close()


def test_file_store_deleted_when_world_size_instances_close(tmp_path):
    path = str(tmp_path / "ws")
    a, b = FileStore(path, world_size=2), FileStore(path, world_size=2)
    a.set("k", b"v")
    a.close()
    assert os.path.exists(path)
    assert b.get("k") == b"v"
    b.close()
    assert not os.path.exists(path)
    with pytest.raises(ChorusError, match="is closed"):
        b.get("k")


def test_file_store_rejects_a_foreign_file(tmp_path):
    path = tmp_path / "foreign"
    path.write_bytes(b"\x09" + bytes(20))
    with pytest.raises(ProtocolError, match="not a chorus store"):
        FileStore(str(path)).get("k", timeout=0)


# -- store codec (pure) ----------------------------------------------------------------

def test_codec_round_trip_and_incremental_parse():
    requests = [
        Request(Op.SET, (b"k", b"v" * 1000)),
        Request(Op.GET, (b"k",), 2500),
        Request(Op.ADD, (b"n",), -3),
        Request(Op.COMPARE_SET, (b"k", b"", b"d")),
        Request(Op.WAIT, (b"a", b"b"), 0),
        Request(Op.NUM_KEYS),
        Request(Op.MULTI_SET, (b"a", b"1", b"b", b"2")),
    ]
    blob = b"".join(codec.pack_request(r) for r in requests)
    parser = RequestParser()
    seen = []
    for i in range(0, len(blob), 3):
        seen += parser.feed(blob[i:i + 3])
    assert seen == requests
    assert RequestParser().feed(blob) == requests
    response = Response(Status.TIMEOUT, (b"x", b"y"), 1500)
    frame = codec.pack_response(response)
    assert codec.parse_length(frame[:4]) == len(frame) - 4
    assert codec.parse_response(frame[4:]) == response


def test_codec_frame_layout():
    frame = codec.pack_request(Request(Op.ADD, (b"key",), 7))
    assert frame == struct.pack("!IBqII", 20, 3, 7, 1, 3) + b"key"


@pytest.mark.parametrize("frame,message", [
    (struct.pack("!I", 1 << 31), "exceeds the limit"),
    (struct.pack("!IBqI", 13, 99, 0, 0), "unknown store op code 99"),
    (struct.pack("!IBqI", 13, 1, 0, 0), "SET got 0 arguments"),
    (struct.pack("!IBqI", 13, 10, 0, 1)[:-4] + struct.pack("!I", 1), "claims 1 arguments"),
    (struct.pack("!IBqII", 17, 2, 0, 1, 9), "runs past the end"),
    (struct.pack("!IBqII", 19, 8, 0, 0, 0) + b"xx", "after its last argument"),
    (struct.pack("!IBqI", 13, 2, -5, 0), "GET got 0 arguments"),
    (struct.pack("!IBqII", 18, 2, -5, 1, 1) + b"k", "negative timeout"),
    (struct.pack("!IBq", 9, 1, 0), "shorter than its fixed part"),
])
def test_codec_rejects_malformed_frames(frame, message):
    with pytest.raises(ProtocolError, match=message):
        RequestParser().feed(frame)


def test_codec_custom_frame_limit():
    with pytest.raises(ProtocolError, match="of 122 bytes exceeds the limit of 100"):
        RequestParser(max_frame=100).feed(codec.pack_request(Request(Op.SET, (b"k", bytes(100)))))


def test_store_is_abstract():
    with pytest.raises(TypeError):
        Store()
