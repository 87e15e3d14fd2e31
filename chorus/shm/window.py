"""A group's shared-memory window: its size and layout, its creation, and numpy views into it.

One window per group, created once (``create`` by group rank 0, ``attach`` by the others,
when chorus.shm.handshake has found that every member shares this host) and reused by
every op::

    offset            size                 what
    0                 4 KiB                magic, world size, slot size, nonce (checked at attach);
                                           at 64 and 128 the wake word and sleep marks
                                           (chorus.shm.sync.Waker)
    4 KiB             W x 192 B            control lines: rank r's counters (chorus.shm.sync)
    ...               2 x 128 B            6 <= W <= 8 only: per parity, every rank's first-sync
                                           arrival and op token side by side (chorus.shm.sync)
    ...               2 x 2 x W x W x 8 B  per parity: send and receive count tables (all_to_all)
    (page aligned)    2 x W x slot         data: per parity, one slot per rank
                      2 x slot             result: per parity, one shared slot

Every region exists twice, for the two *parities*.  The rule that makes one
synchronisation per phase enough (see chorus.shm.phases): what a rank writes in the
phase that ends with sync ``s`` goes into parity ``s % 2`` and is read by the others
only in the next phase, before sync ``s + 1``.  A rank writes that parity again only
after sync ``s + 1``, when every rank has finished reading it.

Each control line also carries the words of single-copy ops (chorus.shm.cma): the rank's
pid, and the address of the buffer the others read in the current op (``publish``), or
the file of its registered buffer (``publish_mapped``; chorus.shm.mapped).

The data slots of one parity are contiguous: ``stack(p, dtype, lo, n)`` is a (W, n)
view of elements ``lo .. lo+n`` of every rank's slot, which a single numpy call can
reduce or copy.

Slots are 1 MiB (``slot_bytes``; 2 MiB in groups of 2), shrunk for large groups to keep
the window within ``CHORUS_SHM_BYTES`` (64 MiB); ``CHORUS_SHM_SLOT_BYTES`` sets them.
The settings that choose a window's algorithms are read once, through chorus.config,
when the group is created (``Settings``), and held by its window.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from chorus import config
from chorus.host.segment import Segment
from chorus.shm import cma
from chorus.shm.registered import OFFSET_BITS, Descriptor
from chorus.shm.sync import ABANDONED, MAPPED, MAPPED_DEVICE, PID, PROBE, SOURCE, UNIFORM, WORDS

MAGIC = b"CHSHM004"  # the layout's version, checked at attach
_HEADER = struct.Struct("<8sQQ16s")  # magic, world, slot bytes, nonce
PAGE = 4096
CONTROL = PAGE
LINE = WORDS * 8
#: Groups of this many ranks get the arrival blocks (one 64-byte line of arrivals and one
#: of tokens per parity; chorus.shm.sync says why not fewer).
PACKED_MIN, PACKED_MAX = 6, 8
ARRIVAL_BLOCK = 128


#: The data area starts this far into a page.  glibc's memcpy (``rep movsb``) runs at a
#: tenth of its speed on some x86 CPUs when the destination is a few bytes ahead of the
#: source modulo 4 KiB, which a page-aligned slot copied into a large numpy array (16
#: bytes into its page) always is; half a page apart avoids it in both directions.
#: A constant, not a setting: every member must compute the same layout (the header
#: check at attach covers world and slot size only).
SKEW = 2048
DEFAULT_SLOT = 1 << 20
#: Two ranks get 2 MiB slots (a window of 12 MiB): all_reduce up to 2 MiB is then one-shot
#: in one chunk (chorus.shm.collectives.one_shot), one sync instead of three: 353-427 us
#: against 520-746 us at 2 MiB, 1 to 16 MiB within the noise either way (``chorus bench
#: --world 2`` with CHORUS_SHM_SLOT_BYTES=1048576 against the default, medians of 3-4 runs).
#: (Messages that are one-shot take no registered buffer: chorus.shm.mapped starts above a
#: slot here.)
PAIR_SLOT = 2 << 20
MIN_SLOT = 64 << 10
#: all_to_all uses registered buffers from this size unless CHORUS_SHM_MAPPED_BYTES is set
#: (chorus.shm.mapped gives the measurements).
MAPPED_ALL_TO_ALL_BYTES = 4 << 20


@dataclass(frozen=True)
class Settings:
    """The settings a window's collectives choose their algorithms by, read through
    chorus.config once, when the group is created (chorus.shm.handshake checks that every
    member has the same ``oneshot_bytes``, ``cma_bytes``, ``mapped_bytes`` and
    ``all_to_all_bytes``: they decide the number of syncs of an op).  A test or a bench
    changes a group's with ``win.settings = dataclasses.replace(win.settings, ...)`` on
    every rank."""

    oneshot_bytes: int  # CHORUS_SHM_ONESHOT_BYTES (chorus.shm.collectives.one_shot)
    cma: bool  # CHORUS_SHM_CMA: this member may read and be read directly (chorus.shm.cma)
    cma_bytes: int  # CHORUS_SHM_CMA_BYTES (0: chorus.shm.direct.MEASURED)
    mapped_bytes: int  # all_reduce/reduce on registered buffers from this size (0: never; chorus.shm.mapped)
    all_to_all_bytes: int  # all_to_all on registered buffers from this size (0: never)
    part_bytes: int  # CHORUS_SHM_PART_BYTES (chorus.shm.phases.parts_for)
    copy_crew_bytes: int  # CHORUS_SHM_COPY_CREW_BYTES (chorus.shm.phases.parts_for)

    @classmethod
    def read(cls) -> Settings:
        """This process's settings now (ConfigError names a value that is not valid)."""
        mapped = config.get("CHORUS_SHM_MAPPED_BYTES") if config.get("CHORUS_SHM_MAPPED") else 0
        explicit = config.is_set("CHORUS_SHM_MAPPED_BYTES") or not mapped
        return cls(oneshot_bytes=config.get("CHORUS_SHM_ONESHOT_BYTES"), cma=config.get("CHORUS_SHM_CMA"),
                   cma_bytes=config.get("CHORUS_SHM_CMA_BYTES") or 0, mapped_bytes=mapped,
                   all_to_all_bytes=mapped if explicit else MAPPED_ALL_TO_ALL_BYTES,
                   part_bytes=config.get("CHORUS_SHM_PART_BYTES"),
                   copy_crew_bytes=config.get("CHORUS_SHM_COPY_CREW_BYTES"))


def _up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


class Layout:
    """Byte offsets of every region for ``world`` ranks and ``slot`` bytes per slot."""

    def __init__(self, world: int, slot: int):
        self.world = world
        self.slot = slot
        self.packed = PACKED_MIN <= world <= PACKED_MAX  # whether the window has the arrival blocks
        self.arrivals = CONTROL + world * LINE
        self.counts = self.arrivals + (2 * ARRIVAL_BLOCK if self.packed else 0)
        self.data = _up(self.counts + 2 * 2 * world * world * 8) + SKEW
        self.result = self.data + 2 * world * slot
        self.size = self.result + 2 * slot


def slot_bytes(world: int) -> int:
    """Bytes per slot: ``CHORUS_SHM_SLOT_BYTES``, else 1 MiB (2 MiB for 2 ranks: ``PAIR_SLOT``),
    shrunk so that the window stays within ``CHORUS_SHM_BYTES`` (default 64 MiB) for large
    groups; at least 64 KiB, which a group of one rank (nothing to share, only copies) gets."""
    explicit = config.get("CHORUS_SHM_SLOT_BYTES")
    if explicit:
        slot = explicit
    elif world == 1:
        slot = MIN_SLOT
    else:
        budget = config.get("CHORUS_SHM_BYTES")
        slot = min(PAIR_SLOT if world == 2 else DEFAULT_SLOT, budget // (2 * (world + 1)))
    return max(MIN_SLOT, slot // 4096 * 4096)


def create(world: int, group: int) -> tuple[Segment, Layout, bytes]:
    """A new window for ``world`` ranks of group ``group`` (its creator's side): the mapped
    file, its layout and the nonce written into its header, which ``attach`` checks."""
    layout = Layout(world, slot_bytes(world))
    segment = Segment.create(layout.size, group)
    nonce = secrets.token_bytes(16)
    _HEADER.pack_into(segment.buf, 0, MAGIC, layout.world, layout.slot, nonce)
    return segment, layout, nonce


def attach(path: str, size: int, world: int, slot: int, nonce: bytes) -> tuple[Segment, Layout]:
    """The window another member created (``create``'s path, size, slot size and nonce);
    OSError unless this rank reads the creator's header through its own mapping (the same
    file on the same /dev/shm)."""
    layout = Layout(world, slot)
    segment = Segment.attach(path, size)
    if layout.size != size or _HEADER.unpack_from(segment.buf, 0) != (MAGIC, world, slot, nonce):
        segment.close()
        raise OSError("the file holds another window (a different /dev/shm?)")
    return segment, layout


def publish_probe(buf, layout: Layout, rank: int, enabled: bool) -> cma.Probe | None:
    """Write ``rank``'s pid and CMA probe (where, and which 8 bytes) into its control line,
    before the window is in use; None (and zeros) unless CMA is ``enabled`` here."""
    probe = None
    if enabled and layout.world > 1:
        cma.allow_peers()
        probe = cma.Probe()
    line = CONTROL + rank * LINE
    values = (0, 0, 0) if probe is None else (probe.pid, probe.address, probe.value)
    for word, v in zip((PID, SOURCE, PROBE), values, strict=True):
        struct.pack_into("<Q", buf, line + 8 * word, v)
    return probe


class Window:
    """Typed views into one mapped window, for rank ``rank``; views are cached per shape.
    ``settings``: the group's (default: this process's now)."""

    def __init__(self, buf, layout: Layout, rank: int, settings: Settings | None = None):
        self.buf = buf
        self.layout = layout
        self.settings = Settings.read() if settings is None else settings
        self.rank = rank
        self.world = layout.world
        self.slot = layout.slot
        self.control = memoryview(buf)[CONTROL: CONTROL + layout.world * LINE].cast("Q")
        a = layout.arrivals
        #: the two arrival blocks (chorus.shm.sync.Sync's ``arrivals``), None where the layout has none
        self.arrivals = memoryview(buf)[a: a + 2 * ARRIVAL_BLOCK] if layout.packed else None
        self._cache: dict[tuple, tuple] = {}
        self.cma = None  # chorus.shm.cma.Peers when the members read each other directly
        self.crew = None  # chorus.shm.phases.Crew when this rank splits large copies among threads
        self.maps = None  # chorus.shm.mapped.PeerMaps when the members map each other's registered buffers

    def words(self, word: int) -> list[int]:
        """Control word ``word`` of every rank (e.g. sync.PID, sync.SOURCE)."""
        c = self.control
        return [int(c[q * WORDS + word]) for q in range(self.world)]

    def publish(self, address: int) -> None:
        """Tell the others where this rank's buffer of the current single-copy op starts."""
        self.control[self.rank * WORDS + SOURCE] = address

    def publish_mapped(self, parity: int, where: Descriptor | None) -> None:
        """Offer this rank's registered buffer of an op that begins in a phase of ``parity``
        to the others (None: it has none).  Per parity, like the all_to_all counts: a rank
        that finished the op may begin the next before all have read this one's offers."""
        c, word = self.control, self.rank * WORDS + MAPPED + 2 * parity
        if where is None:
            c[word] = 0
            return
        c[word + 1] = where.fd << OFFSET_BITS | where.offset
        c[self.rank * WORDS + MAPPED_DEVICE + parity] = where.device
        c[word] = where.inode

    def mapped(self, parity: int) -> list[Descriptor] | None:
        """Every rank's registered buffer offered in ``parity``, or None unless all offered one."""
        c, found = self.control, []
        for q in range(self.world):
            word = q * WORDS + MAPPED + 2 * parity
            inode = int(c[word])
            if not inode:
                return None
            at = int(c[word + 1])
            found.append(Descriptor(at >> OFFSET_BITS, int(c[q * WORDS + MAPPED_DEVICE + parity]), inode,
                                    at & ((1 << OFFSET_BITS) - 1)))
        return found

    def offered(self, parity: int) -> bool:
        """Whether any rank offered a registered buffer in ``parity``."""
        c = self.control
        return any(c[q * WORDS + MAPPED + 2 * parity] for q in range(self.world))

    def gave_up(self, rank: int, seq: int) -> bool:
        """Whether ``rank`` abandoned op ``seq`` (its buffer may be in other hands already)."""
        return self.control[rank * WORDS + ABANDONED] == seq + 1

    def capacity(self, dtype: np.dtype) -> int:
        """Elements of ``dtype`` that fit in one slot."""
        return self.slot // dtype.itemsize

    def stack(self, parity: int, dtype: np.dtype, lo: int, n: int) -> np.ndarray:
        """(W, n) view: elements ``lo .. lo+n`` of every rank's data slot of ``parity``."""
        offset = self.layout.data + parity * self.world * self.slot + lo * dtype.itemsize
        return np.ndarray((self.world, n), dtype, self.buf, offset, (self.slot, dtype.itemsize))

    def slot_of(self, parity: int, rank: int, dtype: np.dtype, lo: int, n: int) -> np.ndarray:
        """Elements ``lo .. lo+n`` of ``rank``'s data slot of ``parity``."""
        offset = self.layout.data + (parity * self.world + rank) * self.slot + lo * dtype.itemsize
        return np.ndarray((n,), dtype, self.buf, offset)

    def pieces(self, parity: int, rank: int, dtype: np.dtype, piece: int, n: int) -> np.ndarray:
        """(W, n) view of ``rank``'s data slot cut into W pieces of ``piece`` elements:
        row q is the first ``n`` elements of piece q (the part meant for rank q)."""
        offset = self.layout.data + (parity * self.world + rank) * self.slot
        return np.ndarray((self.world, n), dtype, self.buf, offset, (piece * dtype.itemsize, dtype.itemsize))

    def region(self, parity: int, dtype: np.dtype, lo: int, n: int) -> np.ndarray:
        """Elements ``lo .. lo+n`` of the whole data area of ``parity`` (all W slots as one)."""
        offset = self.layout.data + parity * self.world * self.slot + lo * dtype.itemsize
        return np.ndarray((n,), dtype, self.buf, offset)

    def result(self, parity: int, dtype: np.dtype, lo: int, n: int) -> np.ndarray:
        """Elements ``lo .. lo+n`` of the shared result slot of ``parity``."""
        offset = self.layout.result + parity * self.slot + lo * dtype.itemsize
        return np.ndarray((n,), dtype, self.buf, offset)

    def tables(self, parity: int) -> tuple[np.ndarray, np.ndarray]:
        """(send, recv) W x W element-count tables of ``parity``: row r is written by rank r."""
        w = self.world
        offset = self.layout.counts + parity * 2 * w * w * 8
        both = np.ndarray((2, w, w), np.uint64, self.buf, offset)
        return both[0], both[1]

    def declare_counts(self, parity: int, send_counts, recv_counts) -> bool:
        """Publish this rank's all_to_all counts for the others: one word when it sends and
        receives one count to and from every rank (the common case; returns True), else its
        rows of the tables of ``parity`` as well (returns False)."""
        first = send_counts[0]
        if send_counts.count(first) == len(send_counts) and recv_counts.count(first) == len(recv_counts):
            self.declare_common(parity, first)
            return True
        self.control[self.rank * WORDS + UNIFORM + parity] = 0
        send, recv = self.tables(parity)
        send[self.rank] = send_counts
        recv[self.rank] = recv_counts
        return False

    def declare_common(self, parity: int, count: int) -> None:
        """``declare_counts`` of a rank that sends and receives ``count`` elements to and
        from every rank."""
        self.control[self.rank * WORDS + UNIFORM + parity] = count + 1

    def common_count(self, parity: int) -> int | None:
        """The count every rank declared (``declare_counts``) when all declared the same
        single count, else None (then ``counts`` gives the tables)."""
        c, first = self.control, self.control[UNIFORM + parity]
        if first == 0:
            return None
        for q in range(1, self.world):
            if c[q * WORDS + UNIFORM + parity] != first:
                return None
        return first - 1

    def counts(self, parity: int) -> tuple[np.ndarray, np.ndarray]:
        """(send, recv) tables of every rank's declared counts (private copies)."""
        send, recv = (t.copy() for t in self.tables(parity))
        for q in range(self.world):
            single = self.control[q * WORDS + UNIFORM + parity]
            if single:
                send[q] = recv[q] = single - 1
        return send, recv

    def small(self, dtype: np.dtype, n: int) -> tuple:
        """Cached ``(mine, stacks)`` for one-shot ops on ``n`` elements of ``dtype``: this
        rank's slot and the (W, n) stack, for each parity."""
        return self._cached((dtype, n), lambda: (
            tuple(self.slot_of(p, self.rank, dtype, 0, n) for p in (0, 1)),
            tuple(self.stack(p, dtype, 0, n) for p in (0, 1))))

    def exchange(self, dtype: np.dtype, block: int) -> tuple:
        """Cached ``(pieces, blocks)`` for all_to_all in one round of ``block`` elements per
        rank pair: per parity, this rank's slot as (W, block) pieces, one for each rank, and
        the (W, block) stack of the pieces every rank filled for this one."""
        piece = self.capacity(dtype) // self.world
        return self._cached(("all_to_all", dtype, block), lambda: (
            tuple(self.pieces(p, self.rank, dtype, piece, block) for p in (0, 1)),
            tuple(self.stack(p, dtype, self.rank * piece, block) for p in (0, 1))))

    def _cached(self, key: tuple, build: Callable[[], tuple]) -> tuple:
        """The views cached under ``key``, built by ``build()`` the first time (at most 256
        kept: then the cache starts over)."""
        views = self._cache.get(key)
        if views is None:
            if len(self._cache) >= 256:
                self._cache.clear()
            views = self._cache[key] = build()
        return views

    def release(self) -> None:
        """Drop the cached views and the control view (so that the mapping can go)."""
        self._cache.clear()
        self.control.release()
        if self.arrivals is not None:
            self.arrivals.release()
