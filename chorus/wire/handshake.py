"""The connection handshake: the first bytes on every chorus TCP connection.

Pure state machines over bytes (no sockets): feed them what the peer sent, send what
they return.  ``chorus.net`` drives them over a blocking socket and the store server
drives them from its event loop.

Theory of operation (1.5 round trips; the client's first request can follow its proof
without waiting)::

    client                                              server
      | -- HELLO(kind=client, flags, purpose, cn) -------> |   cn, sn: fresh 32-byte nonces
      | <-- HELLO(kind=server, flags, purpose, sn, sp) --- |   sp = HMAC(token, "server"|purpose|cn|sn)
      | -- PROOF(cp) ------------------------------------> |   cp = HMAC(token, "client"|purpose|cn|sn)
      |    (only when both sides have a token)             |

Each side checks the other's magic, version, purpose and whether it has a token.  The
client verifies ``sp`` before it sends ``cp``, so it knows the server holds the same
token without waiting for an acknowledgement; the server verifies ``cp``.  The "server"
and "client" labels keep one side's proof from being replayed as the other's, and the
fresh nonces keep old proofs from being replayed at all.  When neither side has a
token, the exchange is the two HELLOs (one round trip) and is unauthenticated.

Every message is a header followed by a body::

    header  magic b"CHRS" (4) | version u16 | body length u16          (big-endian)
    HELLO   kind u8 | flags u8 (bit 0: has token) | purpose (16, NUL-padded)
            | nonce (32) | proof (32, zeros when absent)
    PROOF   kind u8 | proof (32)

On a version or purpose mismatch, or a token on one side only, the server still sends
its HELLO (so that the client can say precisely what differs) and then fails.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

from chorus.errors import AuthenticationError, ProtocolError

MAGIC = b"CHRS"
VERSION = 1
NONCE_SIZE = 32
PROOF_SIZE = 32
PURPOSE_SIZE = 16
MAX_BODY = 1024

KIND_CLIENT_HELLO = 1
KIND_SERVER_HELLO = 2
KIND_PROOF = 3
FLAG_TOKEN = 1

_HEADER = struct.Struct("!4sHH")
_HELLO = struct.Struct(f"!BB{PURPOSE_SIZE}s{NONCE_SIZE}s{PROOF_SIZE}s")
_PROOF = struct.Struct(f"!B{PROOF_SIZE}s")
HEADER_SIZE = _HEADER.size
_NO_PROOF = bytes(PROOF_SIZE)

TOKEN_ADVICE = "pass the same token to every rank and launcher (chorusrun --token-file, or CHORUS_TOKEN)"


@dataclass(frozen=True)
class Hello:
    """A parsed HELLO: who sent it (``kind``), what for, and its nonce and proof."""

    kind: int
    has_token: bool
    purpose: bytes
    nonce: bytes
    proof: bytes


def _pad_purpose(purpose: bytes) -> bytes:
    """Return ``purpose`` NUL-padded to PURPOSE_SIZE bytes; reject empty or long ones."""
    if not purpose or len(purpose) > PURPOSE_SIZE or b"\0" in purpose:
        raise ProtocolError(
            f"handshake purpose {purpose!r} must be 1..{PURPOSE_SIZE} bytes without NULs"
        )
    return purpose.ljust(PURPOSE_SIZE, b"\0")


def pack_header(body_len: int, version: int = VERSION) -> bytes:
    """Return the 8-byte header that announces a body of ``body_len`` bytes."""
    return _HEADER.pack(MAGIC, version, body_len)


def parse_header(data: bytes) -> tuple[int, int]:
    """Parse an 8-byte header; return ``(version, body_len)``.

    Raises ProtocolError when the magic is wrong (the peer does not speak chorus) or
    the announced body is larger than MAX_BODY.
    """
    magic, version, body_len = _HEADER.unpack(bytes(data[:HEADER_SIZE]))
    if magic != MAGIC:
        raise ProtocolError(
            f"the peer is not a chorus endpoint: its first bytes are {bytes(data[:4])!r}, "
            f"expected {MAGIC!r}; check the host and port it connects to"
        )
    if body_len > MAX_BODY:
        raise ProtocolError(f"handshake message of {body_len} bytes exceeds {MAX_BODY}")
    return version, body_len


def pack_hello(kind: int, purpose: bytes, nonce: bytes, has_token: bool,
               proof: bytes = _NO_PROOF) -> bytes:
    """Return a complete HELLO message (header included)."""
    body = _HELLO.pack(kind, FLAG_TOKEN if has_token else 0, _pad_purpose(purpose),
                       nonce, proof)
    return pack_header(len(body)) + body


def parse_hello(body: bytes) -> Hello:
    """Parse a version-1 HELLO body; raise ProtocolError when it is malformed."""
    if len(body) != _HELLO.size:
        raise ProtocolError(f"handshake HELLO body is {len(body)} bytes, expected {_HELLO.size}")
    kind, flags, purpose, nonce, proof = _HELLO.unpack(bytes(body))
    if kind not in (KIND_CLIENT_HELLO, KIND_SERVER_HELLO):
        raise ProtocolError(f"expected a handshake HELLO, got message kind {kind}")
    return Hello(kind, bool(flags & FLAG_TOKEN), purpose.rstrip(b"\0"), nonce, proof)


def pack_proof(proof: bytes) -> bytes:
    """Return a complete PROOF message (header included)."""
    body = _PROOF.pack(KIND_PROOF, proof)
    return pack_header(len(body)) + body


def parse_proof(body: bytes) -> bytes:
    """Parse a PROOF body and return the 32-byte proof; ProtocolError when malformed."""
    if len(body) != _PROOF.size or body[0] != KIND_PROOF:
        raise ProtocolError("expected the handshake PROOF message, got something else")
    return bytes(body[1:])


def make_proof(token: bytes, role: bytes, purpose: bytes, client_nonce: bytes,
               server_nonce: bytes) -> bytes:
    """Return HMAC-SHA256(token, role | padded purpose | client nonce | server nonce)."""
    message = b"chorus-handshake-v1|" + role + b"|" + _pad_purpose(purpose)
    return hmac.new(token, message + client_nonce + server_nonce, hashlib.sha256).digest()


def _check_version(version: int) -> None:
    if version != VERSION:
        raise ProtocolError(
            f"the peer speaks chorus handshake version {version}, this process speaks "
            f"{VERSION}; install the same chorus version on every host"
        )


def _check_purpose(ours: bytes, theirs: bytes) -> None:
    if ours != theirs:
        raise ProtocolError(
            f"the peer opened a {theirs.decode(errors='replace')!r} connection but this "
            f"endpoint serves {ours.decode(errors='replace')!r}; check the port it connects to"
        )


def _check_tokens(ours: bool, theirs: bool, peer: str) -> None:
    if ours and not theirs:
        raise AuthenticationError(
            f"this process has a job token but the {peer} sent none; {TOKEN_ADVICE}"
        )
    if theirs and not ours:
        raise AuthenticationError(
            f"the {peer} has a job token but this process has none; {TOKEN_ADVICE}"
        )


class _Reader:
    """Buffers incoming bytes and hands out whole header+body messages."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._version: int | None = None
        self._body_len = 0

    def bytes_needed(self) -> int:
        """Return how many more bytes complete the message being read."""
        want = HEADER_SIZE if self._version is None else self._body_len
        return max(0, want - len(self._buf))

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_message(self) -> tuple[int, bytes] | None:
        """Return ``(version, body)`` of the next whole message, or None if incomplete."""
        if self._version is None:
            if len(self._buf) < HEADER_SIZE:
                return None
            self._version, self._body_len = parse_header(self._buf)
            del self._buf[:HEADER_SIZE]
        if len(self._buf) < self._body_len:
            return None
        body = bytes(self._buf[:self._body_len])
        del self._buf[:self._body_len]
        version, self._version = self._version, None
        return version, body

    def take_rest(self) -> bytes:
        rest = bytes(self._buf)
        self._buf.clear()
        return rest


class ClientHandshake:
    """The connecting side.  Send ``initial_bytes()``, then feed what the server sends.

    ``receive`` returns the bytes to send next (the PROOF, or b"") and sets ``done``;
    it raises ProtocolError or AuthenticationError when the server is not acceptable.
    ``authenticated`` says whether a token was proven both ways.
    """

    def __init__(self, token: bytes | None, purpose: bytes, nonce: bytes | None = None):
        self._token = token or None
        self._purpose = purpose
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_SIZE)
        _pad_purpose(purpose)
        self._reader = _Reader()
        self.done = False
        self.authenticated = False

    def initial_bytes(self) -> bytes:
        """Return the client HELLO."""
        return pack_hello(KIND_CLIENT_HELLO, self._purpose, self._nonce, self._token is not None)

    def bytes_needed(self) -> int:
        """Return how many more bytes from the server the handshake needs (0 when done)."""
        return 0 if self.done else self._reader.bytes_needed()

    def receive(self, data: bytes) -> bytes:
        """Feed bytes from the server; return bytes to send (possibly b"")."""
        if self.done:
            raise ProtocolError("the handshake is already complete")
        self._reader.feed(data)
        message = self._reader.next_message()
        if message is None:
            return b""
        version, body = message
        _check_version(version)
        hello = parse_hello(body)
        if hello.kind != KIND_SERVER_HELLO:
            raise ProtocolError("the peer answered a client HELLO with a client HELLO; "
                                "both ends connected as clients")
        _check_purpose(self._purpose, hello.purpose)
        _check_tokens(self._token is not None, hello.has_token, "server")
        self.done = True
        if self._token is None:
            return b""
        expected = make_proof(self._token, b"server", self._purpose, self._nonce, hello.nonce)
        if not hmac.compare_digest(expected, hello.proof):
            raise AuthenticationError(
                f"the server proved a different job token than this process has; {TOKEN_ADVICE}"
            )
        self.authenticated = True
        return pack_proof(make_proof(self._token, b"client", self._purpose, self._nonce,
                                     hello.nonce))


class ServerHandshake:
    """The accepting side.  Feed it what the client sends; send what ``receive`` returns.

    After ``receive`` returns, check ``error``: when it is set, send the returned bytes
    (the server HELLO, which lets the client report the same problem) and then fail with
    it.  ``receive`` raises directly (nothing to send) on garbage or a bad proof.  Once
    ``done``, ``leftover`` holds bytes the client sent after the handshake (its first
    request) and ``authenticated`` says whether a token was proven both ways.
    """

    def __init__(self, token: bytes | None, purpose: bytes, nonce: bytes | None = None):
        self._token = token or None
        self._purpose = purpose
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_SIZE)
        _pad_purpose(purpose)
        self._reader = _Reader()
        self._client_nonce: bytes | None = None
        self.done = False
        self.authenticated = False
        self.error: Exception | None = None
        self.leftover = b""

    @property
    def awaiting_proof(self) -> bool:
        """True once the client's HELLO is answered and its token proof is still due."""
        return self._client_nonce is not None and not self.done and self.error is None

    def bytes_needed(self) -> int:
        """Return how many more bytes from the client the handshake needs (0 when done)."""
        return 0 if self.done or self.error else self._reader.bytes_needed()

    def receive(self, data: bytes) -> bytes:
        """Feed bytes from the client; return bytes to send (possibly b"")."""
        if self.done or self.error:
            raise ProtocolError("the handshake is already finished")
        self._reader.feed(data)
        out = b""
        while not (self.done or self.error):
            message = self._reader.next_message()
            if message is None:
                break
            version, body = message
            if self._client_nonce is None:
                out += self._on_hello(version, body)
            else:
                self._on_proof(version, body)
        if self.done:
            self.leftover = self._reader.take_rest()
        return out

    def _on_hello(self, version: int, body: bytes) -> bytes:
        has_token = self._token is not None
        if version != VERSION:
            self.error = _failure(_check_version, version)
            return pack_hello(KIND_SERVER_HELLO, self._purpose, self._nonce, has_token)
        hello = parse_hello(body)
        if hello.kind != KIND_CLIENT_HELLO:
            raise ProtocolError("the peer sent a server HELLO to a server; "
                                "both ends accepted instead of one connecting")
        self._client_nonce = hello.nonce
        proof = _NO_PROOF
        if has_token and hello.has_token:
            proof = make_proof(self._token, b"server", self._purpose, hello.nonce, self._nonce)
        reply = pack_hello(KIND_SERVER_HELLO, self._purpose, self._nonce, has_token, proof)
        self.error = (_failure(_check_purpose, self._purpose, hello.purpose)
                      or _failure(_check_tokens, has_token, hello.has_token, "client"))
        if self.error is None and not has_token:
            self.done = True
        return reply

    def _on_proof(self, version: int, body: bytes) -> None:
        _check_version(version)
        proof = parse_proof(body)
        expected = make_proof(self._token, b"client", self._purpose, self._client_nonce,
                              self._nonce)
        if not hmac.compare_digest(expected, proof):
            raise AuthenticationError(
                f"the client proved a different job token than this process has; {TOKEN_ADVICE}"
            )
        self.done = True
        self.authenticated = True


def _failure(check, *args) -> Exception | None:
    """Run ``check(*args)``; return the exception it raised, or None."""
    try:
        check(*args)
    except (ProtocolError, AuthenticationError) as e:
        return e
    return None
