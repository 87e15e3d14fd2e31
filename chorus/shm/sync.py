"""Waiting: generation counters in the shared window, and waking the ranks that sleep.

Each rank owns one control line of the window (24 x uint64 = 192 bytes, so no two
ranks' lines share a cache line) and is the only one that writes it::

    word  0     ARRIVED    syncs this rank has reached: its generation counter
    words 1-4   OP         (seq + 1, fingerprint) of the shared-memory op it began in a phase
                           of parity 0 | 1 (0: none yet)
    words 5-6   TOKEN      per parity: the token of the op in OP (``token``), written
                           after OP: the first sync's fast check reads one word per rank,
                           from the cache line it has just read ARRIVED from (groups of
                           6 to 8 ranks use the arrival blocks below instead)
    word  7     ABANDONED  seq + 1 of an op it left after an error (0 = none)
    word  8     PID        its process id (written at window creation; chorus.shm.cma)
    word  9     SOURCE     address of its buffer that peers read (all_reduce: and write) in
                           the current single-copy op (chorus.shm.direct); at window
                           creation: of its CMA probe
    word  10    PROBE      the 8 random bytes at that probe (window creation only)
    words 11-12 UNIFORM    all_to_all of parity 0 | 1: count + 1 when this rank sends and
                           receives that count to and from every rank, else 0
                           (chorus.shm.window.Window.declare_counts)
    words 13-15 CURRENT    seq + 1, fingerprint and transport (TCP) of the last op it ran
                           over TCP instead (group.ShmGroup.announce_tcp)
    words 16-19 MAPPED     per parity 0 | 1 (16 + 2 x parity): the inode of the registered
                           buffer this rank offers in an op that begins in a phase of that
                           parity (chorus.shm.registered; 0: none), then its descriptor
                           number << 40 | the buffer's byte offset in the file
    words 20-21 MAPPED_DEVICE  per parity: that file's device number (with the inode, what
                           names the file)

Words 0-7 share one cache line: what a latency-bound op writes (ARRIVED, OP, TOKEN) and
what the others read of it cross between cores as one line per rank.

Groups of 6 to 8 ranks also have *arrival blocks* beside the control lines (chorus.shm.
window): per parity, one 64-byte line with every rank's latest first-sync number and one
with every rank's op token (instead of its TOKEN words)::

    block p, word q        the number of the last first sync of parity p rank q reached
    block p, word W + q    rank q's token of the op it began in a phase of parity p

so that the first sync's check that every rank arrived and began the same op is one
read of 16 x W bytes compared with the bytes it must hold, instead of W - 1 counters and
W - 1 tokens read one by one from W - 1 lines.  A rank one sync ahead writes the other
parity's block, so the block only changes as ranks arrive.  Waiting, checks and error
messages still read the control lines.  Blocks against control lines alone
(``bench/latency_phases.py W OUT 1 20000``, us per op): 8 ranks 9.07-9.77 -> 8.37-8.81,
6 ranks 7.66-9.05 -> 7.65-7.88, but 5 ranks 7.46-7.94 -> 7.93-8.13 and 4 ranks
6.64-8.08 -> 8.10-9.15: fewer lines to save than the block costs to build and to share
(at 4 ranks arrivals and tokens fill one line).  Hence 6 to 8.

A sync is: raise your counter to ``s``, wait until every other counter is >= ``s``.
Writes are plain aligned 8-byte stores; a rank that sees a counter also sees everything
its owner wrote before raising it (x86-64 keeps stores in order; shared memory is enabled
only there unless forced, chorus.shm.handshake).

A sync first reads a missing counter up to ``Backoff.polls`` times (a few µs, without
the clock or a system call; only where every rank has a core of its own, judged on the
members' CPUs together (chorus.shm.placement), or where ``CHORUS_SHM_SPIN_US`` asks for
spinning): most arrivals come within that.  Then waiting backs off so that an
oversubscribed host (more ranks than cores) does not stall: spin for ``spin_s``, then
``os.sched_yield()`` until ``yield_s``, then sleep 50 µs, doubling up to 1 ms — on a
futex that the rank completing the sync wakes (below).  Three yields in a row that take
more than 50 µs each end yielding for one second (every wait polls for 20 µs, then
sleeps): the CPU went to a busy task (a compute thread, another job) that keeps it until
its time slice ends, milliseconds under Linux's EEVDF scheduler, whereas a sleeping
waiter's timer wake-up preempts it.  Every wait has the op's deadline (CommTimeoutError
naming the op, its sequence number and the ranks that did not arrive), and every 2 ms a
waiter asks the group's transport whether a member died, left or called another op — so
a dead peer becomes PeerLostError in milliseconds, well within 5 s — and reads the
missing ranks' CURRENT and ABANDONED words, so that a rank that took another path (TCP)
or gave up after an error is named instead of waited for.  At that check, a wait that has
lasted the group's CHORUS_WAIT_REPORT_S logs the ranks that have not arrived
(chorus.transport.waiting), and again after each further interval.

*Waking.*  A rank that naps would find out that the last rank arrived only when its nap
ends: up to a millisecond late, at every sync where ranks arrive far apart (a DDP bucket
whose gradients are ready at different times on each rank), and the whole op waits for
it.  So a napping rank sleeps on a futex in the window's header page, and the rank whose
arrival completes the sync wakes it (``Waker``)::

    header page, offset 64     WAKE    a 32-bit counter (futex word); any rank bumps it
    header page, offset 128    ASLEEP  one byte per rank: 1 while that rank naps

    waiter r (instead of sleeping ``nap``):   v <- WAKE;  ASLEEP[r] <- 1
                                              if every rank arrived: ASLEEP[r] <- 0, done
                                              futex_wait(WAKE, v, timeout nap);  ASLEEP[r] <- 0
    a rank that finds every rank arrived:     if any ASLEEP: futex_wake_op(WAKE += 1, wake all)

The kernel adds to the word and wakes in one call (``FUTEX_WAKE_OP``), so the word only
ever moves forward: a waiter that read it before the bump finds it changed and does not
sleep.  The nap stays the timeout, so nothing waits longer than a nap: a waiter whose
mark and an arrival cross unseen (x86 may let a load pass an earlier store, and Python
has no fence) sleeps its nap out.  Spurious wake-ups are harmless: the waiter looks at
the counters again.  Where the futex system call is not available (not Linux, a 32-bit
process, an architecture whose call number is not known here), ``Waker.make`` returns
None and waiters nap.

With a recorder attached (chorus.recorder), every ``Sync.sync`` reports a ``sync`` event.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time
from dataclasses import dataclass

import numpy as np

from chorus import recorder
from chorus.errors import AbortedError, CollectiveMismatchError, CommTimeoutError, PeerLostError
from chorus.wire.fingerprint import describe

WORDS = 24
ARRIVED, OP, TOKEN, ABANDONED = 0, 1, 5, 7  # TOKEN: the token of the op in OP (5 + parity)
PID, SOURCE, PROBE = 8, 9, 10  # single-copy (CMA) words, not used by the sync itself
UNIFORM = 11  # all_to_all's count words (11 + parity), not used by the sync itself
CURRENT = 13  # an op run over TCP instead (3 words)
MAPPED = 16  # a registered buffer's words (16 + 2 x parity, 2 words; chorus.shm.mapped), not used by the sync itself
MAPPED_DEVICE = 20  # its file's device number (20 + parity)
SHM, TCP = 1, 2  # CURRENT's transport word
CHECK_S = 0.002
NAP_MIN, NAP_MAX = 50e-6, 1e-3
SLOW_YIELD_S = 50e-6  # a sched_yield() this long means another task held the CPU ...
SLOW_YIELDS = 3  # ... and after this many in a row ...
SLEEP_ONLY_S = 1.0  # ... waits skip yielding this long (polling 20 µs, then sleeping), then try again
SLEEPER_SPIN_S = 20e-6
ORDER = sys.byteorder  # of the words, as the arrival blocks' expected bytes are built


#: ``token``'s multiplier (odd, so a bijection of 64-bit words) and the words' mask.
SPREAD, MASK = 0x9E3779B97F4A7C15, (1 << 64) - 1


def token(seq: int, fingerprint: int) -> int:
    """The word that says which op a rank began: one for every (seq, fingerprint) the
    first sync compares.  Fingerprints are bit fields (chorus.wire.fingerprint): gather and
    scatter of the same arguments differ in bit 0, as do seq + 1 = 2 and 3, so a plain
    ``(seq + 1) ^ fingerprint`` let a rank one seq ahead in gather take a peer in scatter
    for the same op.  Multiplied by an odd constant, fingerprints that differ from bit j on
    differ in bit j and, all but certainly, in bits far above those of any two seqs a few
    ops apart.  The same fingerprint with another seq, or the same seq with another
    fingerprint, always gives another token."""
    return (seq + 1) ^ (fingerprint * SPREAD & MASK)


@dataclass(frozen=True)
class Backoff:
    """How long a waiter spins, then yields, before it sleeps (seconds), and how many
    times a sync reads a missing counter before it starts waiting at all."""

    spin_s: float = 0.0
    yield_s: float = 5e-3
    polls: int = 0  # reads of a missing counter (no clock, no system call) before a sync starts waiting


WAKE_OFFSET = 64  # in the window's header page (chorus.shm.window)
ASLEEP_OFFSET = 128
HEADER_PAGE = 4096
MAX_RANKS = HEADER_PAGE - ASLEEP_OFFSET  # one byte per rank in the header page

_FUTEX_WAIT, _FUTEX_WAKE_OP = 0, 5  # shared (not FUTEX_PRIVATE_FLAG): the ranks are processes
#: FUTEX_WAKE_OP's operation: add 1 to the word (FUTEX_OP_ADD, oparg 1); its comparison
#: (FUTEX_OP_CMP_EQ 0) only decides a second wake-up of no waiters (val2 = 0).
_ADD_ONE = (1 << 28) | (0 << 24) | (1 << 12) | 0
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


_syscall = None


def _futex_call():
    """libc's ``syscall`` set up for futex, and the call's number; None where unknown."""
    global _syscall
    number = _SYS_FUTEX.get(platform.machine().lower())  # the kernel's architecture ...
    if number is None or not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None  # ... which a 32-bit process on a 64-bit kernel does not share
    if _syscall is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).syscall
        except (OSError, AttributeError):
            return None
        fn.restype = ctypes.c_long
        fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                       ctypes.POINTER(_Timespec), ctypes.c_void_p, ctypes.c_int]
        _syscall = fn
    return _syscall, number


class Waker:
    """Rank ``rank``'s side of one window's wake word and sleep marks (see above)."""

    def __init__(self, buf, world: int, rank: int, call):
        self._fn, self._number = call
        self.rank = rank
        # The word's address, for the system call; the view that gave it is dropped at once,
        # so that it does not keep the mapping exported (the address stays valid while the
        # window is mapped, and the window is unmapped only after the group's last op).
        self._address = np.frombuffer(buf, np.uint32, count=1, offset=WAKE_OFFSET).__array_interface__["data"][0]
        self.word = memoryview(buf)[WAKE_OFFSET: WAKE_OFFSET + 4].cast("I")
        self.marks = memoryview(buf)[ASLEEP_OFFSET: ASLEEP_OFFSET + world]
        words = -(-world // 8)
        # The marks read 8 at a time (bytes past the last rank stay 0; the page is zeroed).
        self.asleep = memoryview(buf)[ASLEEP_OFFSET: ASLEEP_OFFSET + 8 * words].cast("Q")
        self._timeout = _Timespec()
        self.wakes = 0  # futex_wake calls made (tests check the path was taken)

    @classmethod
    def make(cls, buf, world: int, rank: int) -> Waker | None:
        """A Waker for the window in ``buf``, or None where waiters must nap instead."""
        call = _futex_call()
        if call is None or world > MAX_RANKS:
            return None
        return cls(buf, world, rank, call)

    def sleep(self, seconds: float, arrived) -> None:
        """Sleep until woken or for ``seconds``, unless ``arrived()`` (every rank reached the
        sync) is already true once this rank is marked asleep."""
        value = self.word[0]
        self.marks[self.rank] = 1
        try:
            if arrived():
                return
            t = self._timeout
            t.sec, t.nsec = int(seconds), int((seconds % 1.0) * 1e9)
            self._fn(self._number, self._address, _FUTEX_WAIT, value, t, None, 0)
        finally:
            self.marks[self.rank] = 0

    def wake(self) -> None:
        """Wake every rank that sleeps on the window, if any is marked asleep."""
        for word in self.asleep:
            if word:
                self._fn(self._number, self._address, _FUTEX_WAKE_OP, _WAKE_ALL, None, self._address, _ADD_ONE)
                self.wakes += 1
                return

    def release(self) -> None:
        for view in (self.word, self.marks, self.asleep):
            view.release()


class Sync:
    """Rank ``rank``'s side of the counters of one window.

    ``members`` are the global ranks (for messages); ``transport`` is the group's
    transport, asked about dead peers and broken groups while waiting.
    """

    def __init__(self, control: memoryview, rank: int, members: tuple[int, ...], transport,
                 group: int, backoff: Backoff, waker: Waker | None = None,
                 arrivals: memoryview | None = None, report=None):
        self.control = control
        self._world = w = len(members)
        if arrivals is None:  # tokens in the control lines; the first sync reads them one by one
            self._blocks = None
            self._tokens, self._token_word = control, (rank * WORDS + TOKEN, rank * WORDS + TOKEN + 1)
        else:  # the two arrival blocks (see the module's doc), one per parity, each half the view
            half = len(arrivals) // 2  # bytes per block (chorus.shm.window.ARRIVAL_BLOCK)
            self._blocks = (arrivals[: 16 * w], arrivals[half: half + 16 * w])
            self._tokens = self._arrivals = arrivals.cast("Q")
            self._token_word = (w + rank, half // 8 + w + rank)
            self._arrival_word = (rank, half // 8 + rank)
        self.waker = waker  # napping waiters sleep until the last arrival (None: they nap)
        # W <= 8: the one word of sleep marks, read here before calling the waker at all
        self._marks = waker.asleep if waker is not None and len(waker.asleep) == 1 else None
        self.rank = rank
        self.members = members
        self.transport = transport
        self.group = group
        self.backoff = backoff
        self.report = report  # the group's chorus.transport.waiting.WaitReport (None: no reports)
        self.mine = rank * WORDS
        self.others = tuple(q * WORDS for q in range(len(members)) if q != rank)
        self.count = int(control[self.mine + ARRIVED])  # 0 for a fresh window
        self.sleep_only_until = 0.0  # monotonic time until which waits sleep, not yield
        self.slow_yields = 0  # slow yields in a row

    def release(self) -> None:
        """Drop the views of the arrival blocks (so that the window's mapping can go)."""
        if self._blocks is not None:
            for view in (*self._blocks, self._arrivals):
                view.release()
            self._blocks = None

    @property
    def parity(self) -> int:
        """The parity this rank writes in the current phase."""
        return self.count & 1

    def announce(self, seq: int, fingerprint: int, transport: int) -> None:
        """Publish that this rank runs op ``seq`` elsewhere (TCP), for waiters to name it.
        The seq word goes to 0 while the others change (see ``_current``)."""
        c, m = self.control, self.mine + CURRENT
        c[m] = 0
        c[m + 1] = fingerprint
        c[m + 2] = transport
        c[m] = seq + 1

    def begin(self, seq: int, fingerprint: int) -> None:
        """Start an op on the shared-memory path: publish its call, for the first sync's
        check and for waiters (``_latest``).  The fingerprint is stored before the seq word,
        so a reader that sees the new seq also sees its fingerprint; the words of this
        parity were last written by an earlier op, past whose first sync every reader is."""
        c, p = self.control, self.count & 1
        m = self.mine + OP + 2 * p
        c[m + 1] = fingerprint
        c[m] = seq + 1
        self._tokens[self._token_word[p]] = (seq + 1) ^ (fingerprint * SPREAD & MASK)  # token(seq, fingerprint)

    def abandon(self, seq: int) -> None:
        """Tell the others this rank left op ``seq`` half-way (they stop waiting for it)."""
        self.control[self.mine + ABANDONED] = seq + 1

    def drain(self, ctx, seconds: float) -> None:
        """After abandoning op ``ctx`` half-way, wait at most ``seconds`` until every other
        rank has arrived at this rank's next sync or abandoned the op too (a dead rank is
        not waited for): until then a single-copy peer may still read or write this rank's
        buffers, which the caller is about to get back."""
        c, target, end = self.control, self.count + 1, time.monotonic() + seconds
        dead = self.transport.dead
        busy = [i for i in self.others if self.members[i // WORDS] not in dead]
        while busy and time.monotonic() < end:
            busy = [i for i in busy if c[i + ARRIVED] < target and c[i + ABANDONED] <= ctx.seq]
            if busy:
                time.sleep(NAP_MIN)

    def sync(self, ctx, first: bool = False) -> None:
        """Arrive at the next sync and wait for every other rank to arrive.

        ``first``: this is the op's first sync; check every rank began the same call.
        """
        if recorder.current is not None:
            self._recorded(ctx, first)
        elif first:
            if not self.arrive_first(ctx.seq, ctx.fingerprint):
                self.settle_first(ctx)
        else:
            target = self._arrive()
            if not self._polled(target):
                self._wait(target, ctx)
            else:
                self._wake_sleepers()

    def _recorded(self, ctx, first: bool) -> None:
        """``sync``, reported to the recorder."""
        start = time.perf_counter()
        if first:
            if not self.arrive_first(ctx.seq, ctx.fingerprint):
                self.settle_first(ctx)
        else:
            target = self._arrive()
            if not self._polled(target):
                self._wait(target, ctx)
            else:
                self._wake_sleepers()
        recorder.transfer("sync", ctx, "shm", start, first=first)

    def arrive_first(self, seq: int, fingerprint: int) -> bool:
        """Arrive at the first sync of op ``(seq, fingerprint)`` and poll the others a few
        times (``_polled``): True if every one arrived and began the same op, and the sync
        is done.  False: finish it with ``settle_first``, which waits, checks and raises.
        (Split so that the latency path builds the op's context only when it has to wait.)"""
        c, polls = self.control, self.backoff.polls
        target = self.count + 1  # self._arrive() and self._polled(target), inlined
        self.count = target
        c[self.mine] = target
        t, token = TOKEN + ((target - 1) & 1), (seq + 1) ^ (fingerprint * SPREAD & MASK)  # token(), inlined
        blocks = self._blocks
        if blocks is not None:  # one read of the parity's arrival block (see the module's doc)
            p = (target - 1) & 1
            self._arrivals[self._arrival_word[p]] = target
            block, w = blocks[p], self._world
            expect = target.to_bytes(8, ORDER) * w + token.to_bytes(8, ORDER) * w
            polls //= 2  # a block read and compare takes about twice as long as a counter read
            while block.tobytes() != expect:
                if polls <= 0:
                    return False
                polls -= 1
            self._wake_sleepers()
            return True
        for i in self.others:
            while c[i] < target:
                if polls <= 0:
                    return False
                polls -= 1
            if c[i + t] != token:  # (in the line ARRIVED came in)
                return False
        self._wake_sleepers()
        return True

    def settle_first(self, ctx) -> None:
        """The rest of a first sync that ``arrive_first`` reported unfinished: wait for
        every other rank, then check that each began op ``ctx``."""
        c, target = self.control, self.count
        self._wait(target, ctx)  # returns at once if every rank arrived
        o = OP + 2 * ((target - 1) & 1)
        seq, fp = ctx.seq + 1, ctx.fingerprint
        for i in self.others:
            if c[i + o] != seq or c[i + o + 1] != fp:
                raise self._mismatch(i // WORDS, c[i + o] - 1, c[i + o + 1], ctx)

    def arrive_next(self) -> bool:
        """Arrive at the next sync (not an op's first) and poll the others a few times:
        True if every one arrived and the sync is done; False: finish it with ``settle``.
        (``sync`` split, as ``arrive_first`` / ``settle_first``, so that the latency path
        builds the op's context only when it has to wait.)"""
        target = self._arrive()
        if not self._polled(target):
            return False
        self._wake_sleepers()
        return True

    def settle(self, ctx) -> None:
        """The rest of a sync that ``arrive_next`` reported unfinished: wait for every
        other rank (deadline, failure checks and reports as in ``sync``)."""
        self._wait(self.count, ctx)

    def _arrive(self) -> int:
        """Raise this rank's counter to the next sync; return that sync's number."""
        target = self.count + 1
        self.count = target
        self.control[self.mine] = target
        return target

    def _polled(self, target: int) -> bool:
        """Whether every other rank reached sync ``target`` within ``Backoff.polls`` reads
        of the missing counters (no clock, no system call)."""
        c, polls = self.control, self.backoff.polls
        for i in self.others:
            while c[i] < target:
                if polls <= 0:
                    return False
                polls -= 1
        return True

    def _wake_sleepers(self) -> None:
        """This rank saw every rank arrive: wake the ones that sleep in the sync, if any
        (a waker checks the marks itself, this the one word of W <= 8)."""
        marks = self._marks
        if marks is not None:
            if marks[0]:
                self.waker.wake()
        elif self.waker is not None:
            self.waker.wake()

    def _pending(self, target: int) -> list[int]:
        c = self.control
        return [i // WORDS for i in self.others if c[i] < target]

    def _wait(self, target: int, ctx) -> None:
        c, others, b = self.control, self.others, self.backoff
        start = time.monotonic()
        next_check = start + CHECK_S
        report = self.report
        next_line = start + report.interval if report is not None and report.interval else float("inf")
        nap = NAP_MIN
        polls = 0
        spinning = b.spin_s > 0
        slept = False
        while True:
            for i in others:
                if c[i] < target:
                    break
            else:
                if not slept:
                    self._wake_sleepers()  # perhaps the last to arrive (it saw the others late)
                return
            polls += 1
            if spinning and polls & 63:
                continue  # spin: look at the clock only now and then
            now = time.monotonic()
            if now >= next_check:
                self._check(target, ctx)
                next_check = now + CHECK_S
                if now >= next_line:
                    missing = [self.members[q] for q in self._pending(target)]
                    if missing:
                        report.line(missing, ctx.label(), now - start)
                    next_line = now + report.interval
            if ctx.deadline is not None and now >= ctx.deadline:
                raise self._timeout(target, ctx, now - start)
            waited = now - start
            if waited < b.spin_s:
                continue
            spinning = False
            if now < self.sleep_only_until:
                if waited < SLEEPER_SPIN_S:
                    continue  # a sleeper polls briefly first: most waits end within µs
            elif waited < b.yield_s:
                os.sched_yield()
                if time.monotonic() - now <= SLOW_YIELD_S:
                    self.slow_yields = 0
                else:
                    # Yields that gave the CPU to a busy neighbour (a compute thread, another
                    # job) until its time slice ended: milliseconds, which nothing can cut
                    # short.  After a few in a row, sleep instead for a while: a timer
                    # wake-up preempts the neighbour.
                    self.slow_yields += 1
                    if self.slow_yields >= SLOW_YIELDS:
                        self.slow_yields = 0
                        self.sleep_only_until = time.monotonic() + SLEEP_ONLY_S
                continue
            if self.waker is None:
                time.sleep(nap)
            else:
                self.waker.sleep(nap, lambda: all(c[i] >= target for i in others))
                slept = True
            nap = min(2 * nap, NAP_MAX)

    def _check(self, target: int, ctx) -> None:
        """Raise if waiting on can no longer succeed (dead or departed peer, broken group,
        a missing rank that went another way or gave up)."""
        c, t = self.control, self.transport
        for q in self._pending(target):  # first what the missing ranks say about themselves
            base = q * WORDS
            gave_up, current = c[base + ABANDONED], self._latest(base)
            if c[base + ARRIVED] >= target:
                continue  # it arrived since (and may be in its next op already)
            if gave_up and gave_up - 1 <= ctx.seq:
                raise AbortedError(
                    f"{ctx.describe()}: rank {self.members[q]} gave up op #{gave_up - 1} after an error "
                    "(see its output); the group's shared-memory window is out of step and the group "
                    "is unusable")
            if current is not None:
                seq, fp, path = current
                if seq > ctx.seq or (seq == ctx.seq and (fp != ctx.fingerprint or path != SHM)):
                    raise self._mismatch(q, seq, fp, ctx, path)
        error = self.transport_error(ctx)
        if error is not None:
            raise error
        for q in self._pending(target):
            who = self.members[q]
            if who in t.left and c[q * WORDS + ARRIVED] < target:
                raise PeerLostError(
                    f"{ctx.describe()}: rank {who} left the job (destroy_process_group) without "
                    f"joining this op; every rank of the group must call it", lost_rank=who)

    def transport_error(self, ctx) -> Exception | None:
        """What the group's transport knows went wrong (a dead or departed member, a
        mismatch told by a peer), as the error op ``ctx`` raises; None if nothing."""
        error = self.transport.failure(self.group, None, expect=(ctx.seq, ctx.fingerprint))
        if isinstance(error, PeerLostError):
            return PeerLostError(f"{ctx.describe()}: {error}", error.lost_rank, error.reporter)
        return error

    def _latest(self, base: int) -> tuple[int, int, int] | None:
        """(seq, fingerprint, transport) of the latest op a rank began (its OP words, SHM)
        or announced (CURRENT, TCP), or None if it began none yet."""
        c, found = self.control, self._current(base)
        for o in (base + OP, base + OP + 2):
            seq = c[o]
            if seq and (found is None or seq - 1 > found[0]):
                found = (seq - 1, c[o + 1], SHM)
        return found

    def _current(self, base: int) -> tuple[int, int, int] | None:
        """(seq, fingerprint, transport) of the op a rank announced, or None while it is
        changing: its seq word is read before and after the others (a seqlock; a store
        seen implies every store its owner made before it, on x86)."""
        c = self.control
        seq = c[base + CURRENT]
        fp, path = c[base + CURRENT + 1], c[base + CURRENT + 2]
        if seq == 0 or c[base + CURRENT] != seq:
            return None
        return seq - 1, fp, path

    def _mismatch(self, q: int, seq: int, fp: int, ctx, path: int = SHM) -> CollectiveMismatchError:
        """The error for rank ``q`` having called (seq, fp) where this rank is in ``ctx``:
        the transport notes what every member shows in the window at either op, tells the
        group's other members (TCP peers learn it too) and names every rank's call."""
        culprit = self.members[q]
        mine = self.members[self.rank]
        why = None
        if seq == ctx.seq and fp == ctx.fingerprint and path != SHM:
            why = (f"rank {culprit} ran {describe(fp)} (op #{seq}) over TCP while rank {mine} used "
                   "shared memory: algorithm=, CHORUS_ALGO_* and CHORUS_TRANSPORT must be the same "
                   "on every rank")
        shown = {self.members[i]: latest[:2] for i in range(len(self.members))
                 if (latest := self._latest(i * WORDS)) is not None and latest[0] in (seq, ctx.seq)}
        self.transport.note_calls(self.group, {**shown, culprit: (seq, fp)})
        self.transport.group_mismatch(self.group, culprit, seq, fp, mine)
        return self.transport.mismatch_error(self.group, (ctx.seq, ctx.fingerprint), why)

    def _timeout(self, target: int, ctx, waited: float) -> CommTimeoutError:
        missing = [self.members[q] for q in self._pending(target)]
        return CommTimeoutError(
            f"{ctx.describe()}: Timed out after {waited:.1f} s (the group's timeout): rank(s) {missing} "
            f"did not arrive at shared-memory sync #{target}; they are hung, slow, or called another op. "
            "Their output (or py-spy dump) shows where they are.")
