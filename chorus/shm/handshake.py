"""The members' census: which members share a host, and whether they agree to share memory.

Run by every member when a group is created (``init_process_group``, ``new_group``),
over the group's transport; the window itself is made by chorus.shm.window::

    member m > 0                               group rank 0
    --- host digest (below), --------------->
        algorithm settings, CPU affinity       all digests equal and usable, all settings
                                               equal? (settings differ: every member
                                               raises InvalidArgumentError naming them)
                                                 create the window (a file with a random nonce)
    <-- offer: path, size, nonce (or none), -
        the members' CPUs (chorus.shm.placement)
    map it, check the nonce
    --- attached / failed ----------------->
                                               UNLINK the file: every member has mapped
                                               it (or given up); no name is left behind
    <-- verdict: use it / use TCP ----------
    <-- hosts: every member's host index ---   (only with "use TCP": a group spanning
                                               hosts runs hierarchically, chorus.api.hierarchy)
    probe every other member (CMA)             (only with "use it")
    --- could read and write them or not -->
    <-- single copy: yes / no --------------

Each member reads its settings once, first (chorus.shm.window.Settings, through
chorus.config): the group's window keeps them.  Every member publishes its pid and a probe (8 random bytes) in its control line before
it acks; once the window is in use, each member reads and writes back every other
member's probe with process_vm_readv/writev (chorus.shm.cma), and the group reads peers'
buffers directly for large messages only if every member could (``CHORUS_SHM_CMA=0`` on
any member: no).

From the unlink on, the window exists only as the members' mappings and vanishes with
them, whatever way they end (``kill -9`` included).  Only a rank 0 killed between
creating and unlinking (milliseconds) leaves a file, named after the job for
``chorus.host.segment.sweep``.  A group of one rank creates and unlinks at once.

Shared memory is used only when *every* member is on this host; a group spanning hosts
learns which member is on which host, so that it can run shared memory inside each host
and TCP between them.  ``CHORUS_TRANSPORT=tcp`` turns it off (and with it the hierarchy),
``=shm`` makes its absence an error.

*Host ids.*  Two ranks can share a window when they run on the same machine *and* see
the same ``/dev/shm``.  LOCAL_RANK / LOCAL_WORLD_SIZE say neither (containers, odd
launchers, several jobs per node): a Gloo shared-memory all-reduce was merged and
reverted for trusting them.  So the id is built from what the kernel says:

    boot_id               /proc/sys/kernel/random/boot_id: this machine, this boot
    /dev/shm st_dev, ino  which tmpfs instance (a container with its own /dev/shm differs)

and ranks with equal ids are then *verified* by the nonce above.  Containers that share
``/dev/shm`` (``--ipc=host``) get one id and shared memory, whatever their hostnames.
``CHORUS_HOST_ID`` overrides the detection, for tests: one value for this process, or a
comma-separated list indexed by global rank (ranks as threads of one process can then
pretend to live on different hosts): ``CHORUS_HOST_ID=a,a,b,b``.
"""

from __future__ import annotations

import logging
import struct
import time

from chorus.errors import InvalidArgumentError
from chorus.host.identity import NO_HOST, host_digest, platform_ok, transport_mode
from chorus.shm import cma, placement, window
from chorus.shm.group import ShmGroup
from chorus.shm.mapped import PeerMaps
from chorus.shm.sync import PID, PROBE, SOURCE
from chorus.shm.window import Settings
from chorus.wire.frames import Kind

log = logging.getLogger("chorus")

TAG = -0x43485348  # "CHSH": the handshake's point-to-point tag (users' tags are other numbers)
#: window bytes (0: no window), slot bytes, nonce, path, and the CPUs of members whose
#: affinities do not overlap (0: they overlap, or unknown; chorus.shm.placement)
_OFFER = struct.Struct("<QQ16s256sQ")
_NO_HOST_INDEX = 0xFFFFFFFF  # in the hosts table: a member without usable shared memory
NO, YES, FORCED_BUT_IMPOSSIBLE, SETTINGS_DIFFER = 0, 1, 2, 3
#: The settings that choose a shared-memory algorithm (and so the number of syncs of an
#: op): members with different ones would fall out of step without noticing, so they
#: must all have the same (checked here).
_SETTINGS = struct.Struct("<QQQQ")
_NO_OVERRIDE = 0


Hosts = tuple[int | None, ...]  # per group rank: its host, numbered 0.. in order of first appearance


def create(transport, group: int, members: tuple[int, ...], rank: int,
           timeout: float) -> tuple[ShmGroup | None, Hosts]:
    """(the group's ShmGroup for this member (group rank ``rank``) or None to use TCP, the
    host of every member): a, a, b, a -> (0, 0, 1, 0); None for a member that cannot use
    shared memory (no usable /dev/shm, ``CHORUS_TRANSPORT=tcp``)."""
    mode = transport_mode()
    settings = Settings.read()
    wanted = mode == "shm" or (mode == "auto" and platform_ok())
    digest = host_digest(members[rank]) if wanted else NO_HOST
    talk = _Talk(transport, group, members, time.monotonic() + timeout)
    if rank == 0:
        return _lead(talk, digest, mode, members, settings)
    return _follow(talk, digest, rank, settings)


def _settings(settings: Settings) -> bytes:
    """The settings that choose algorithms, as the members compare them:
    ``CHORUS_SHM_ONESHOT_BYTES``, ``CHORUS_SHM_CMA_BYTES`` (0: not set) and the sizes from
    which registered buffers are used (0: off)."""
    return _SETTINGS.pack(settings.oneshot_bytes, settings.cma_bytes, settings.mapped_bytes,
                          settings.all_to_all_bytes)


def _describe_settings(packed: bytes) -> str:
    oneshot, cma_bytes, mapped_bytes, all_to_all_bytes = _SETTINGS.unpack(packed)
    return (f"CHORUS_SHM_ONESHOT_BYTES={oneshot}, "
            f"CHORUS_SHM_CMA_BYTES={'unset' if cma_bytes == _NO_OVERRIDE else cma_bytes}, "
            f"CHORUS_SHM_MAPPED_BYTES={mapped_bytes or 'off'} (all_to_all: {all_to_all_bytes or 'off'})")


def _settings_error(group: int, who: str, theirs: bytes, mine: bytes) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"group {group}: the members' shared-memory settings differ: {who} ({_describe_settings(theirs)}) "
        f"against group rank 0 ({_describe_settings(mine)}). They choose the algorithms, so ranks "
        "with different ones would fall out of step: set them the same on every rank, or on none.")


def _lead(talk: _Talk, digest: bytes, mode: str, members: tuple[int, ...],
          settings: Settings) -> tuple[ShmGroup | None, Hosts]:
    world = len(members)
    mine = _settings(settings)
    first = talk.gather(32 + _SETTINGS.size + placement.INFO_BYTES)
    digests, theirs = [m[:32] for m in first], [m[32:32 + _SETTINGS.size] for m in first]
    apart = placement.combine([placement.info(), *(m[32 + _SETTINGS.size:] for m in first)])
    why = _refusal([digest, *digests], members)
    odd = [i for i, t in enumerate(theirs) if t != mine] if why is None else []
    if odd:
        why = f"rank(s) {[members[i + 1] for i in odd]} have other shared-memory settings"
    segment, trouble = None, False  # trouble: shared memory should have worked but did not
    probe = None  # this member's CMA probe: alive until the group agreed on single copy
    if why is None:
        try:
            segment, layout, nonce = window.create(world, talk.group)
        except OSError as exc:
            why, trouble = str(exc), True
    try:
        if segment is None:
            talk.scatter(_OFFER.pack(0, 0, b"", b"", 0))
            talk.gather(1)
            verdict = SETTINGS_DIFFER if odd else FORCED_BUT_IMPOSSIBLE if mode == "shm" else NO
        else:
            probe = window.publish_probe(segment.buf, layout, 0, settings.cma)
            talk.scatter(_OFFER.pack(layout.size, layout.slot, nonce, segment.path.encode(), apart))
            acks = talk.gather(1)
            failed = [members[i + 1] for i, a in enumerate(acks) if a != b"\x01"]
            if failed:
                why, trouble = f"rank(s) {failed} could not map the window (see their log)", True
                verdict = FORCED_BUT_IMPOSSIBLE if mode == "shm" else NO
            else:
                verdict = YES
    finally:
        if segment is not None:
            segment.unlink()
    talk.scatter(bytes([verdict]))
    if verdict == SETTINGS_DIFFER:
        talk.scatter(mine)
        raise _settings_error(talk.group, f"rank {members[odd[0] + 1]}", theirs[odd[0]], mine)
    if verdict == YES:
        shm = ShmGroup(segment, layout, 0, members, talk.transport, talk.group,
                       placement.backoff(talk.transport, world, apart), placement.threads(talk.transport, world),
                       settings)
        _single_copy(talk, shm, probe)
        return shm, (0,) * world
    hosts = _host_table([digest, *digests])
    if verdict == NO:
        talk.scatter(struct.pack(f"<{world}I", *(_NO_HOST_INDEX if h is None else h for h in hosts)))
    if segment is not None:
        segment.close()
    if why and world > 1:
        (log.warning if trouble else log.info)("chorus: group %d uses TCP, not shared memory: %s",
                                               talk.group, why)
    _raise_if_forced(verdict, talk.group, why)
    return None, hosts


def _follow(talk: _Talk, digest: bytes, rank: int, settings: Settings) -> tuple[ShmGroup | None, Hosts]:
    mine = _settings(settings)
    talk.send_to_lead(digest + mine + placement.info())
    size, slot, nonce, path, apart = _OFFER.unpack(talk.recv_from_lead(_OFFER.size))
    segment = None
    probe = None  # this member's CMA probe: alive until the group agreed on single copy
    if size:
        try:
            segment, layout = window.attach(path.rstrip(b"\0").decode(), size, len(talk.members), slot, nonce)
            probe = window.publish_probe(segment.buf, layout, rank, settings.cma)
        except (OSError, ValueError) as exc:
            log.warning("chorus: rank %d cannot map group %d's shared-memory window: %s",
                        talk.members[rank], talk.group, exc)
            if segment is not None:
                segment.close()
            segment = None
    talk.send_to_lead(b"\x01" if segment is not None else b"\x00")
    verdict = talk.recv_from_lead(1)[0]
    world = len(talk.members)
    if verdict == SETTINGS_DIFFER:
        lead = talk.recv_from_lead(_SETTINGS.size)
        if lead != mine:
            raise _settings_error(talk.group, f"rank {talk.members[rank]} (this rank)", mine, lead)
        raise InvalidArgumentError(
            f"group {talk.group}: another member's shared-memory settings differ from group rank 0's "
            f"({_describe_settings(lead)}, the same as this rank's); that member's error names them. "
            "Set them the same on every rank, or on none.")
    if verdict == YES:
        shm = ShmGroup(segment, layout, rank, talk.members, talk.transport, talk.group,
                       placement.backoff(talk.transport, world, apart), placement.threads(talk.transport, world),
                       settings)
        _single_copy(talk, shm, probe)
        return shm, (0,) * world
    if segment is not None:
        segment.close()
    _raise_if_forced(verdict, talk.group, "see group rank 0's log")
    table = struct.unpack(f"<{world}I", talk.recv_from_lead(4 * world))
    return None, tuple(None if h == _NO_HOST_INDEX else h for h in table)


def _single_copy(talk: _Talk, shm: ShmGroup, probe: cma.Probe | None) -> None:
    """Agree whether the group's large collectives read peers' buffers directly: every
    member probes every other one and votes; group rank 0 sends the (unanimous) verdict.
    Every member's probe stays alive until the verdict, when all are done probing it."""
    win = shm.window
    if win.world == 1:
        return
    why = "CHORUS_SHM_CMA=0" if probe is None else cma.probe(
        win.rank, win.words(PID), win.words(SOURCE), win.words(PROBE))
    vote = b"\x01" if why is None else b"\x00"
    if win.rank == 0:
        agreed = why is None and all(v == b"\x01" for v in talk.gather(1))
        talk.scatter(b"\x01" if agreed else b"\x00")
    else:
        talk.send_to_lead(vote)
        agreed = talk.recv_from_lead(1) == b"\x01"
    if why is not None:
        log.info("chorus: group %d copies large messages through its window (no single copy): %s",
                 talk.group, why)
    if agreed:
        win.cma = cma.Peers(win.words(PID))
        if win.settings.mapped_bytes:  # opening /proc/<pid>/fd/N needs what CMA needs
            win.maps = PeerMaps(win.words(PID), shm.sync.members)


def _host_table(digests: list[bytes]) -> Hosts:
    """Each member's host index (0.. in order of first appearance), None for NO_HOST."""
    index: dict[bytes, int] = {}
    return tuple(None if d == NO_HOST else index.setdefault(d, len(index)) for d in digests)


def _refusal(digests: list[bytes], members: tuple[int, ...]) -> str | None:
    """Why the group cannot share memory, or None if it can."""
    if any(d == NO_HOST for d in digests):
        off = [members[i] for i, d in enumerate(digests) if d == NO_HOST]
        return f"rank(s) {off} have no usable /dev/shm or run with CHORUS_TRANSPORT=tcp"
    if len(set(digests)) > 1:
        away = [members[i] for i, d in enumerate(digests) if d != digests[0]]
        return f"rank(s) {away} are on another host than rank {members[0]}"
    return None


def _raise_if_forced(verdict: int, group: int, why: str | None) -> None:
    if verdict == FORCED_BUT_IMPOSSIBLE:
        raise InvalidArgumentError(f"CHORUS_TRANSPORT=shm but group {group} cannot use shared memory: "
                                   f"{why}. Use CHORUS_TRANSPORT=auto to fall back to TCP.")


class _Talk:
    """Fixed-size messages between group rank 0 and the other members."""

    def __init__(self, transport, group: int, members: tuple[int, ...], deadline: float):
        self.transport = transport
        self.group = group
        self.members = members
        self.deadline = deadline

    def _wait(self, handles: list) -> None:
        self.transport.wait_all(handles, self.deadline,
                                lambda: f"setting up group {self.group}'s shared-memory window")

    def _send(self, peer: int, data: bytes):
        return self.transport.isend(peer, memoryview(data), kind=Kind.DATA, group=self.group, tag=TAG,
                                    sync=True)

    def _recv(self, peer: int, view: memoryview):
        return self.transport.irecv(peer, view, kind=Kind.DATA, group=self.group, tag=TAG)

    def gather(self, nbytes: int) -> list[bytes]:
        peers = self.members[1:]
        bufs = [bytearray(nbytes) for _ in peers]
        self._wait([self._recv(peer, memoryview(b)) for peer, b in zip(peers, bufs, strict=True)])
        return [bytes(b) for b in bufs]

    def scatter(self, data: bytes) -> None:
        self._wait([self._send(peer, data) for peer in self.members[1:]])

    def send_to_lead(self, data: bytes) -> None:
        self._wait([self._send(self.members[0], data)])

    def recv_from_lead(self, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        self._wait([self._recv(self.members[0], memoryview(buf))])
        return bytes(buf)
