"""Stores: every op on every store type, timeouts, FileStore across processes, the codec."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from store_support import TOKEN

from chorus.errors import (
    ChorusError,
    InvalidArgumentError,
    ProtocolError,
    StoreTimeoutError,
)
from chorus.store import FileStore, HashStore, PrefixStore, Store, TCPStore
from chorus.wire import store_codec as codec
from chorus.wire.store_codec import Op, Request, RequestParser, Response, Status


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
    with pytest.raises(StoreTimeoutError, match=" Timed out after 0.15s "):
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


def test_codec_refuses_long_frames_without_buffering_them_and_stays_in_step():
    """refuse_over: a longer frame is dropped as it comes (never held), a Refused takes its
    place, and the frames around it parse, however the bytes are cut."""
    small = Request(Op.SET, (b"a", b"1"))
    big = codec.pack_request(Request(Op.SET, (b"k", bytes(5000))))
    blob = codec.pack_request(small) + big + codec.pack_request(small)
    for step in (1, 7, 4096, len(blob)):
        parser = RequestParser(refuse_over=1000)
        seen = []
        for i in range(0, len(blob), step):
            seen += parser.feed(blob[i:i + step])
            assert len(parser._buf) <= 1000 + 4  # noqa: SLF001 - what the parser holds
        assert seen == [small, codec.Refused(len(big) - 4), small]
