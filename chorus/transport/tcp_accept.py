"""Accepting a rank's incoming transport connections, strangers and floods included.

Theory of operation: one thread accepts; each accepted connection is admitted by a
thread of its own — the token handshake (``chorus.net``), the HELLO naming the rank and
the job's session, the shared-memory offer (``shm_link``) — the whole of it within
``CHORUS_HANDSHAKE_TIMEOUT`` seconds however slowly its bytes trickle in (a slow-loris
holds nothing longer).  At most ``CHORUS_MAX_PENDING_CONNECTIONS`` are admitted at once
(``net.Pending``): with no room, the oldest connection that has not sent its opening
message within a quarter of a second is shed for the newcomer (its thread ends at once),
else the newcomer waits for room.  A flood thus costs no more threads and descriptors
than that, and drains from the listen backlog quickly; a rank's own connection opens at
once, so it is never shed (and one shed before the handshake answered, in a burst of
them, is made again: ``net.connect_and_handshake``).  Out of descriptors (EMFILE,
ENFILE) the loop logs once, pauses (10 ms, doubling to 1 s) and goes on accepting: it
ends only when the listener is closed.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable

from chorus import config, net
from chorus.errors import ProtocolError
from chorus.transport import shm_link
from chorus.wire.frames import HEADER_SIZE, Kind, unpack_header

log = logging.getLogger("chorus")

BACKOFF_S = (0.01, 1.0)  # first and longest pause when out of descriptors
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

Register = Callable[[int, socket.socket, "shm_link.Pairing | None"], None]


class Doorway:
    """Admits rank ``rank``'s peers ``rank+1 ..`` on ``listener``; ``register(peer, sock,
    pairing)`` takes each admitted connection, ``connected(peer)`` says whether a peer
    already has one.  Settings are read here, when the transport is created."""

    def __init__(self, listener: socket.socket, *, rank: int, world_size: int, token: bytes | None,
                 session: int, connected: Callable[[int], bool], register: Register, rings: bool = True):
        self.listener = listener
        self.rank = rank
        self.world_size = world_size
        self.token = token
        self.session = session
        self.rings = rings  # offer connecting peers shared-memory rings (chorus.transport.shm_link)
        self.connected: Callable[[int], bool] | None = connected
        self.register: Register | None = register  # both dropped at close: no cycle to the transport
        self.handshake_s = config.get("CHORUS_HANDSHAKE_TIMEOUT")
        self.pending = net.Pending(net.pending_limit())
        self.closed = False

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name=f"chorus-accept-r{self.rank}", daemon=True).start()

    def close(self) -> None:
        """Stop accepting (the accept loop wakes and ends)."""
        self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept()
        except OSError:
            pass
        self.listener.close()
        self.connected = self.register = None

    def _accept_loop(self) -> None:
        pause, starved = BACKOFF_S[0], False
        while not self.closed:
            try:
                sock, addr = self.listener.accept()
            except OSError as exc:
                if self.closed or exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # the listener was closed
                if exc.errno not in OUT_OF_DESCRIPTORS:
                    log.warning("chorus rank %d: accept failed (%s); still accepting", self.rank, exc)
                    continue
                if not starved:
                    log.warning("chorus rank %d: out of file descriptors, cannot accept connections (%s); "
                                "pausing and retrying (a flood of connections, or raise `ulimit -n`)",
                                self.rank, exc)
                    starved = True
                time.sleep(pause)
                pause = min(2 * pause, BACKOFF_S[1])
                continue
            pause = BACKOFF_S[0]
            self._make_room()
            self.pending.add(sock)
            try:
                threading.Thread(target=self._admit, args=(sock, addr), daemon=True,
                                 name=f"chorus-admit-r{self.rank}").start()
            except RuntimeError as exc:  # no thread to spare: drop this one
                log.warning("chorus rank %d: dropped a connection from %s: %s", self.rank, addr, exc)
                self.pending.remove(sock)
                sock.close()

    def _make_room(self) -> None:
        """Wait until one more connection may be handshaken, shedding the oldest that has
        not opened yet if need be (its admit thread ends on the shut-down socket)."""
        while not self.closed:
            room, victim, wait = self.pending.room()
            if victim is not None:
                if self.pending.shed == 1:
                    log.warning("chorus rank %d: %d connections are handshaking and more arrive: shedding "
                                "the oldest that sent nothing within %g s (a flood of connections?)",
                                self.rank, self.pending.limit, net.SHED_AFTER_S)
                try:
                    victim.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if room:
                return
            self.pending.wait(wait)

    def _admit(self, sock: socket.socket, addr) -> None:
        """Handshake an incoming connection; close and log anything that is not a rank."""
        deadline = time.monotonic() + self.handshake_s
        try:
            net.server_handshake(sock, self.token, b"transport", self.handshake_s,
                                 opened=lambda: self.pending.opened(sock))
            hello = unpack_header(net.recv_exact(sock, HEADER_SIZE, deadline))
            session = int.from_bytes(net.recv_exact(sock, 8, deadline), "little")
            peer = hello.tag
            if hello.kind != Kind.HELLO or hello.group != self.world_size or session != self.session:
                raise ProtocolError("first frame is not a HELLO of this job")
            if not self.rank < peer < self.world_size:
                raise ProtocolError(f"HELLO names rank {peer}, which must not connect to rank {self.rank}")
            connected, register = self.connected, self.register
            if connected is None or register is None:
                raise ProtocolError("the transport is closed")
            if connected(peer):
                raise ProtocolError(f"rank {peer} is already connected")
            pairing = shm_link.acceptor_side(sock, self.rank, peer, self.world_size, deadline, self.rings)
            register(peer, sock, pairing)
        except TimeoutError:
            log.warning("chorus rank %d: closed a transport connection from %s: no complete handshake "
                        "within %g s (CHORUS_HANDSHAKE_TIMEOUT)", self.rank, addr, self.handshake_s)
            sock.close()
        except Exception as exc:  # noqa: BLE001 - whatever a stranger sends, the job goes on
            level = logging.DEBUG if self.pending.was_shed(sock) else logging.WARNING  # a flood: one warning
            log.log(level, "chorus rank %d: rejected a transport connection from %s: %s", self.rank, addr, exc)
            sock.close()
        finally:
            self.pending.remove(sock)
