"""The connection handshake: pure state machines fed bytes, then over real sockets."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import pytest
from proc_support import held_port

from chorus import net
from chorus.errors import AuthenticationError, ProtocolError, RendezvousError
from chorus.wire import handshake as hs
from chorus.wire.handshake import ClientHandshake, ServerHandshake

CN, SN = b"c" * 32, b"s" * 32


def run_pure(client: ClientHandshake, server: ServerHandshake, chunk: int | None = None):
    """Shuttle bytes between two machines; return (server leftover, client finish bytes)."""
    def feed(machine, data):
        if chunk is None:
            return machine.receive(data)
        out = b""
        for i in range(0, len(data), chunk):
            out += machine.receive(data[i:i + chunk])
        return out

    reply = feed(server, client.initial_bytes())
    if server.error:
        raise server.error
    finish = feed(client, reply)
    if finish:
        feed(server, finish)
    return finish


# -- pure wire -------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_same_token_authenticates_both_sides(chunk):
    client = ClientHandshake(b"secret", b"store", nonce=CN)
    server = ServerHandshake(b"secret", b"store", nonce=SN)
    finish = run_pure(client, server, chunk)
    assert client.done and server.done
    assert client.authenticated and server.authenticated
    assert len(finish) == hs.HEADER_SIZE + 33
    assert server.leftover == b""


def test_messages_are_deterministic_given_nonces_and_layout_is_documented():
    hello = ClientHandshake(b"t", b"store", nonce=CN).initial_bytes()
    magic, version, body_len = struct.unpack("!4sHH", hello[:8])
    assert (magic, version, body_len) == (b"CHRS", 1, 82)
    assert hello[8] == hs.KIND_CLIENT_HELLO and hello[9] == hs.FLAG_TOKEN
    assert hello[10:26] == b"store".ljust(16, b"\0")
    assert hello[26:58] == CN and hello[58:90] == bytes(32)
    assert hello == ClientHandshake(b"t", b"store", nonce=CN).initial_bytes()


def test_fresh_nonces_differ_between_handshakes():
    a = ClientHandshake(None, b"store").initial_bytes()
    b = ClientHandshake(None, b"store").initial_bytes()
    assert a[26:58] != b[26:58]


def test_no_token_on_either_side_is_one_round_trip_and_unauthenticated():
    client = ClientHandshake(None, b"transport", nonce=CN)
    server = ServerHandshake(None, b"transport", nonce=SN)
    reply = server.receive(client.initial_bytes())
    assert server.done and not server.authenticated and server.error is None
    assert client.receive(reply) == b""
    assert client.done and not client.authenticated


def test_leftover_bytes_after_the_proof_are_kept_for_the_protocol():
    client = ClientHandshake(b"k", b"store", nonce=CN)
    server = ServerHandshake(b"k", b"store", nonce=SN)
    finish = client.receive(server.receive(client.initial_bytes()))
    server.receive(finish + b"first-request")
    assert server.done and server.leftover == b"first-request"


def test_wrong_token_is_rejected_by_the_client():
    client = ClientHandshake(b"right", b"store", nonce=CN)
    server = ServerHandshake(b"wrong", b"store", nonce=SN)
    reply = server.receive(client.initial_bytes())
    with pytest.raises(AuthenticationError, match="different job token.*CHORUS_TOKEN"):
        client.receive(reply)


def test_forged_client_proof_is_rejected_by_the_server():
    server = ServerHandshake(b"right", b"store", nonce=SN)
    server.receive(ClientHandshake(b"attacker", b"store", nonce=CN).initial_bytes())
    assert server.awaiting_proof
    forged = hs.make_proof(b"guess", b"client", b"store", CN, SN)
    with pytest.raises(AuthenticationError, match="different job token.*--token"):
        server.receive(hs.pack_proof(forged))
    assert not server.done


def test_server_proof_cannot_be_reflected_as_client_proof():
    server = ServerHandshake(b"k", b"store", nonce=SN)
    reply = server.receive(ClientHandshake(b"k", b"store", nonce=CN).initial_bytes())
    server_proof = reply[-32:]
    assert server_proof == hs.make_proof(b"k", b"server", b"store", CN, SN)
    with pytest.raises(AuthenticationError):
        server.receive(hs.pack_proof(server_proof))


@pytest.mark.parametrize("client_token,server_token,who", [
    (None, b"k", "server has a job token but this process has none"),
    (b"k", None, "this process has a job token but the server sent none"),
])
def test_token_on_one_side_only_fails_on_both_sides(client_token, server_token, who):
    client = ClientHandshake(client_token, b"store", nonce=CN)
    server = ServerHandshake(server_token, b"store", nonce=SN)
    reply = server.receive(client.initial_bytes())
    assert isinstance(server.error, AuthenticationError)
    assert "CHORUS_TOKEN" in str(server.error)
    with pytest.raises(AuthenticationError, match=who):
        client.receive(reply)


def test_purpose_mismatch_is_a_protocol_error_on_both_sides():
    client = ClientHandshake(None, b"transport", nonce=CN)
    server = ServerHandshake(None, b"store", nonce=SN)
    reply = server.receive(client.initial_bytes())
    assert isinstance(server.error, ProtocolError)
    assert "'transport' connection but this endpoint serves 'store'" in str(server.error)
    with pytest.raises(ProtocolError, match="'store' connection but this endpoint serves 'transport'"):
        client.receive(reply)


def test_version_mismatch_names_both_versions():
    body = bytes(82)
    server = ServerHandshake(None, b"store", nonce=SN)
    reply = server.receive(hs.pack_header(len(body), version=7) + body)
    assert isinstance(server.error, ProtocolError)
    assert "version 7, this process speaks 1" in str(server.error)
    assert reply[:4] == b"CHRS"  # the server still says who it is
    client = ClientHandshake(None, b"store", nonce=CN)
    with pytest.raises(ProtocolError, match="version 9, this process speaks 1"):
        client.receive(hs.pack_header(82, version=9) + body)


def test_garbage_is_a_protocol_error():
    server = ServerHandshake(b"k", b"store")
    with pytest.raises(ProtocolError, match="not a chorus endpoint.*b'GET '"):
        server.receive(b"GET / HTTP/1.1\r\n\r\n")


def test_oversized_and_malformed_messages_are_rejected():
    with pytest.raises(ProtocolError, match="exceeds 1024"):
        ServerHandshake(None, b"store").receive(hs.pack_header(5000))
    with pytest.raises(ProtocolError, match="HELLO body is 3 bytes"):
        ServerHandshake(None, b"store").receive(hs.pack_header(3) + b"abc")
    two_servers = ServerHandshake(None, b"store", nonce=SN)
    server_hello = hs.pack_hello(hs.KIND_SERVER_HELLO, b"store", CN, False)
    with pytest.raises(ProtocolError, match="both ends accepted"):
        two_servers.receive(server_hello)
    client = ClientHandshake(None, b"store")
    with pytest.raises(ProtocolError, match="both ends connected as clients"):
        client.receive(hs.pack_hello(hs.KIND_CLIENT_HELLO, b"store", SN, False))


def test_purpose_must_fit():
    with pytest.raises(ProtocolError, match="1..16 bytes"):
        ClientHandshake(None, b"x" * 17)


# -- net helpers -----------------------------------------------------------------------

def test_get_token(monkeypatch):
    monkeypatch.delenv("CHORUS_TOKEN", raising=False)
    assert net.get_token() is None
    assert net.get_token("abc") == b"abc"
    assert net.get_token(b"\x00\x01") == b"\x00\x01"
    monkeypatch.setenv("CHORUS_TOKEN", "from-env")
    assert net.get_token() == b"from-env"
    assert net.get_token("explicit") == b"explicit"
    monkeypatch.setenv("CHORUS_TOKEN", "")
    assert net.get_token() is None


def test_warn_unauthenticated_once(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="chorus")
    monkeypatch.setattr(net, "_warned", False)
    net.warn_unauthenticated_once("store connection")
    net.warn_unauthenticated_once("transport connection")
    messages = [r.getMessage() for r in caplog.records if r.name == "chorus"]
    assert len(messages) == 1
    assert "the store connection is open to anyone" in messages[0]
    assert "CHORUS_TOKEN" in messages[0]


def both_sides(client_token, server_token, client_purpose=b"store", server_purpose=b"store",
               timeout=5.0):
    """Handshake over a socketpair; return (client exception, server exception)."""
    a, b = socket.socketpair()
    a.settimeout(17.0)
    results = {}

    def serve():
        try:
            net.server_handshake(b, server_token, server_purpose, timeout)
            results["server"] = None
        except Exception as e:
            results["server"] = e
        finally:
            b.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        net.client_handshake(a, client_token, client_purpose, timeout)
        results["client"] = None
    except Exception as e:
        results["client"] = e
    restored = a.gettimeout()
    a.close()
    t.join(10)
    assert restored == 17.0  # the socket's own timeout is back
    return results["client"], results["server"]


def test_socketpair_right_token_is_accepted():
    assert both_sides(b"tok", b"tok") == (None, None)


def test_socketpair_no_token_is_accepted_and_warns(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="chorus")
    monkeypatch.setattr(net, "_warned", False)
    assert both_sides(None, None, b"transport", b"transport") == (None, None)
    assert any("the transport connection is open to anyone" in r.getMessage()
               for r in caplog.records)


def test_socketpair_wrong_token_fails_on_both_sides():
    client_error, server_error = both_sides(b"tok", b"other")
    assert isinstance(client_error, AuthenticationError)
    assert isinstance(server_error, AuthenticationError)
    assert "--token" in str(server_error) and "CHORUS_TOKEN" in str(client_error)


@pytest.mark.parametrize("client_token,server_token", [(None, b"tok"), (b"tok", None)])
def test_socketpair_missing_token_fails_on_both_sides(client_token, server_token):
    client_error, server_error = both_sides(client_token, server_token)
    assert isinstance(client_error, AuthenticationError), client_error
    assert isinstance(server_error, AuthenticationError), server_error


def test_socketpair_purpose_mismatch():
    client_error, server_error = both_sides(None, None, b"transport", b"store")
    assert isinstance(client_error, ProtocolError) and "serves 'transport'" in str(client_error)
    assert isinstance(server_error, ProtocolError) and "serves 'store'" in str(server_error)


def test_socketpair_garbage_is_rejected_by_the_server():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"\xff" * 100)
        with pytest.raises(ProtocolError, match="not a chorus endpoint"):
            net.server_handshake(b, b"tok", b"store", 2.0)


def test_socketpair_garbage_is_rejected_by_the_client():
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        with pytest.raises(ProtocolError, match="not a chorus endpoint"):
            net.client_handshake(a, None, b"store", 2.0)


def test_silent_peer_times_out_with_a_protocol_error_and_restores_timeout():
    a, b = socket.socketpair()
    with a, b:
        start = time.monotonic()
        with pytest.raises(ProtocolError, match="within 0.2s"):
            net.server_handshake(b, None, b"store", 0.2)
        assert time.monotonic() - start < 2
        assert b.gettimeout() is None


def test_peer_closing_instead_of_proving_is_an_authentication_error():
    a, b = socket.socketpair()
    with b:
        client = ClientHandshake(b"x", b"store")
        a.sendall(client.initial_bytes())
        threading.Timer(0.1, a.close).start()
        with pytest.raises(AuthenticationError, match="instead of proving"):
            net.server_handshake(b, b"y", b"store", 5.0)


def test_recv_exact_and_eof():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"hello world")
        assert net.recv_exact(b, 5) == b"hello"
        buf = bytearray(6)
        net.recv_into_exact(b, memoryview(buf))
        assert buf == b" world"
        a.sendall(b"ab")
        a.close()
        with pytest.raises(ConnectionError, match="after 2 of 4 expected bytes"):
            net.recv_exact(b, 4)


def test_listen_binds_host_only_and_reports_real_port():
    with net.listen("127.0.0.1", 0) as sock:
        host, port = sock.getsockname()[:2]
        assert host == "127.0.0.1" and port > 0
        with pytest.raises(RendezvousError) as info:
            net.listen("127.0.0.1", port)
        message = str(info.value)
        assert f"127.0.0.1:{port}" in message and "already in use" in message
        assert "--master-port 0" in message and "MASTER_PORT" in message


def test_listen_on_a_foreign_address_says_so():
    with pytest.raises(RendezvousError, match="192.0.2.1:0.*address of this machine"):
        net.listen("192.0.2.1", 0)


def test_connect_retries_until_the_server_appears():
    port = held_port()
    holder = {}

    def start_later():
        time.sleep(0.3)
        holder["server"] = net.listen("127.0.0.1", port)

    t = threading.Thread(target=start_later)
    t.start()
    start = time.monotonic()
    sock = net.connect("127.0.0.1", port, timeout=10)
    elapsed = time.monotonic() - start
    t.join()
    with sock, holder["server"]:
        assert 0.2 < elapsed < 5
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert sock.gettimeout() is None


def test_connect_gives_up_at_the_deadline_naming_the_address():
    port = held_port()
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        net.connect("127.0.0.1", port, timeout=0.3)
    assert 0.25 < time.monotonic() - start < 3
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "0.3s allowed" in message
    assert "MASTER_ADDR/MASTER_PORT" in message
