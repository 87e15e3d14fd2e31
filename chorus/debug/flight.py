"""The flight recorder: every group keeps its last N ops, always, for a few list appends per op.

When a job hangs or fails, what each rank was doing — which op it had reached, which it
was waiting in and for whom — is what tells the cause.  Each group holds a :class:`Ring`
(``CHORUS_FLIGHT_RECORDER_SIZE`` ops, default 2000; 0 turns it off), made at the group's
first op, cut back to its last N ops now and then (:func:`trim`):

* ``log``: an Entry (a list, see ``CALL`` .. ``SEQ``) per op of the general path, appended
  by chorus.components.base.run_in_order in issue order: the Call while the op is queued
  or running (then, so as not to keep the caller's buffers alive, its fingerprint, bytes,
  async flag and requested algorithm), the component and algorithm, the state (queued,
  started, done, failed), the times (issued, started, ended), the error, the sequence
  number;
* ``lanes``: one list per latency lane (all_reduce: the shared-memory component's,
  chorus.components.shm, or the TCP lane's, chorus.components.tcp_lane; all_to_all; the
  CUDA component's all_reduce, chorus.cuda.plans.LaneLog), to which the lane appends each
  op's sequence number; and
  ``keys``, one list per lane of ``(index, plan key)``: whenever the lane changes plans it
  notes its plan key (``(dtype, op, shape, plan)`` or ``(dtype, shape, plan)``, which it
  holds already) with the index in its list from which the ops ran with it.
  ``ring.done = seq`` when an op returns; a lane op that raises is noted in ``ring.errors``.

A lane's record has to cost a few percent of an op of a few microseconds, so it is one
specialised list append and two attribute stores or tests: no modulo (an unspecialised
int operation that allocates), no allocation, and no clock read per op — reading the
clock costs 60-180 ns on a VM whose clock_gettime leaves the vDSO.  The lanes read it
only when ``seq`` reaches ``ring.clock_at`` (:func:`tick`): about once per millisecond of
ops while they come fast, at every op once they are a millisecond or more apart.  A lane
op's time in the dump is then the latest reading at or before it (``"timed":
"sampled"``): at most about a millisecond early while ops come fast — but after a pause
it may be the time before the pause, until the next reading.

It is not a recorder listener (chorus.recorder): the latency lanes step aside while one
is attached, and the general path is several times slower than a lane on small ops.
The peers an op waits for are not tracked per op either: a wait that times out or fails
names them in its error (chorus.transport.handles, chorus.shm.sync), and the dump reads
them from there.

``dump(path, rank)`` writes one rank's rings as JSON (``dump_flight_recorder`` is the
public name); with ``CHORUS_FLIGHT_RECORDER_DIR`` set every rank writes
``DIR/rank<N>.json`` on any chorus error raised by an op (``failed``) and on SIGTERM or
SIGINT (``install_signal_dumps``, done by init_process_group).  ``chorus analyze DIR``
(chorus.debug.analyze) reads the files of all ranks.

The file::

    {"version": 1, "rank": 2, "pid": 4242, "host": "node1", "reason": "CommTimeoutError: ...",
     "time": <unix seconds of the dump>,
     "groups": [{"id": 0, "name": "WORLD", "members": [0, 1, 2, 3], "group_rank": 2,
                 "size": 2000,
                 "entries": [{"seq": 5, "op": "all_reduce", "dtype": "float32", "count": 4,
                              "nbytes": 16, "reduce_op": "SUM", "root": -1, "async": false,
                              "component": "shm", "algorithm": "window", "lane": true,
                              "state": "failed", "issued": <unix s>, "started": <unix s>,
                              "ended": <unix s>, "timed": "sampled",
                              "error": "CommTimeoutError: ...", "lost_rank": null,
                              "waiting_on": [2], "fingerprint": ..., "call": "all_reduce(...)"},
                             ...]}]}
"""

from __future__ import annotations

import bisect
import json
import os
import re
import signal
import socket
import threading
import time

from chorus import config
from chorus.errors import ChorusError, InvalidArgumentError, InvalidTensorError
from chorus.wire.dtypes import dtype_name
from chorus.wire.fingerprint import COLLECTIVES, REDUCE_OPS, describe

__all__ = ["Ring", "attach", "dump", "dump_flight_recorder", "failed", "failed_lane", "run_lane", "forget",
           "install_signal_dumps", "snapshot", "tick", "trim"]

clock = time.perf_counter
SAMPLE_S = 1e-3  # the lanes read the clock about this often while ops come fast
MAX_STEP = 1024  # and at least every this many ops

QUEUED, STARTED, DONE, FAILED = "queued", "started", "done", "failed"
# An Entry's fields (a list: its state and times change as the op runs).
CALL, COMPONENT, ALGORITHM, STATE, ISSUED, STARTED_AT, ENDED_AT, ERROR, SEQ = range(9)

VERSION = 1


class Ring:
    """The last ``size`` ops of one group on this rank (see the module docstring)."""

    __slots__ = ("group", "name", "members", "group_rank", "size", "log", "lanes", "keys", "trim_at",
                 "done", "errors", "clock_at", "clock_seq", "clock_t", "samples")

    def __init__(self, group: int, name: str, members: tuple[int, ...], group_rank: int, size: int):
        self.group = group
        self.name = name
        self.members = members
        self.group_rank = group_rank
        self.size = size
        self.log: list[list] = []  # the general path's Entries, in issue order
        # the seqs of the CPU all_reduce lane's ops, all_to_all's, the CUDA all_reduce lane's
        self.lanes: tuple[list[int], list[int], list[int]] = ([], [], [])
        self.keys: tuple[list, list, list] = ([], [], [])  # per lane: (index in it, plan key) at each change
        self.trim_at = size + MAX_STEP  # a list this long is cut back (trim)
        self.done = -1  # the latest lane op that returned
        self.errors: dict[int, tuple[str, float, int | None]] = {}  # lane seq -> (error, time, lost rank)
        self.clock_at = 0  # the lanes read the clock at this op (tick)
        self.clock_seq, self.clock_t = -1, 0.0  # the last reading
        self.samples: list[tuple[int, float]] = []  # (seq, time) of the readings, oldest first

    def ops(self) -> list[tuple[int, object]]:
        """The last ``size`` ops as (seq, item), oldest first: an item is an Entry, or the
        plan key a lane op ran with."""
        held = [(entry[SEQ], entry) for entry in list(self.log)]  # copies: ops may go on meanwhile
        for lane, keys in zip(self.lanes, self.keys, strict=True):
            keys = list(keys)
            seqs = list(lane)
            for n, (start, key) in enumerate(keys):
                end = keys[n + 1][0] if n + 1 < len(keys) else len(seqs)
                held.extend((seq, key) for seq in seqs[max(start, 0):end])
        held.sort(key=lambda pair: pair[0])
        return held[-self.size:]

    def entries(self) -> list[dict]:
        """Every op held, oldest first, as the dump writes them (times: perf_counter)."""
        held = self.ops()
        readings = sorted([*self.samples, *((seq, item[ISSUED]) for seq, item in held if type(item) is list)])
        seqs = [seq for seq, _ in readings]
        out = []
        for seq, item in held:
            issued = None
            if type(item) is not list:
                k = bisect.bisect_right(seqs, seq) - 1
                issued = readings[k][1] if k >= 0 else None
            out.append(_entry(seq, item, issued, self))
        return out


def _trim_lane(lane: list[int], keys: list, keep: int) -> None:
    """Keep the last ``keep`` ops of a lane, and the plan keys they ran with."""
    cut = len(lane) - keep
    if cut <= 0:
        return
    del lane[:cut]
    moved = [(index - cut, key) for index, key in keys]
    first = max((n for n, (index, _) in enumerate(moved) if index <= 0), default=0)
    keys[:] = [(max(index, 0), key) for index, key in moved[first:]]


def trim(ring: Ring) -> None:
    """Cut the lists back to their last ``size`` ops (and the clock readings to theirs)."""
    if len(ring.log) > ring.size:
        del ring.log[:len(ring.log) - ring.size]
    for lane, keys in zip(ring.lanes, ring.keys, strict=True):
        if len(lane) > ring.size:
            _trim_lane(lane, keys, ring.size)
    if len(ring.samples) > ring.size:
        del ring.samples[:len(ring.samples) - ring.size]


def tick(ring: Ring, seq: int) -> None:
    """Read the clock for lane op ``seq`` and choose the op at which to read it next:
    about ``SAMPLE_S`` of ops later at the pace since the last reading (every op when
    they are that far apart; at most ``MAX_STEP`` ops later).  Trims the lists."""
    now = clock()
    ring.samples.append((seq, now))
    step = 1
    if ring.clock_seq >= 0 and seq > ring.clock_seq and now > ring.clock_t:
        per_op = (now - ring.clock_t) / (seq - ring.clock_seq)
        step = max(1, min(MAX_STEP, int(SAMPLE_S / per_op)))
    ring.clock_seq, ring.clock_t, ring.clock_at = seq, now, seq + step
    lanes = ring.lanes
    if max(len(lanes[0]), len(lanes[1]), len(lanes[2]), len(ring.samples)) > ring.trim_at:
        trim(ring)


# rank (global) -> group id -> Ring; several ranks only when ranks are threads (chorus.testing)
_rings: dict[int, dict[int, Ring]] = {}
_lock = threading.Lock()


def attach(pg) -> Ring | None:
    """``pg``'s Ring (made now if it has none), also set as ``pg.flight``; None when the
    flight recorder is off (``CHORUS_FLIGHT_RECORDER_SIZE=0``) or this rank is not a member."""
    ring = pg.__dict__.get("flight")
    if ring is not None or "flight" in pg.__dict__:
        return ring
    size = config.get("CHORUS_FLIGHT_RECORDER_SIZE")
    rank = pg.rank()
    if size <= 0 or rank < 0:
        pg.flight = None
        return None
    ring = Ring(pg.id, pg.name, tuple(pg.members), rank, size)
    with _lock:
        _rings.setdefault(pg.members[rank], {})[pg.id] = ring
    pg.flight = ring
    return ring


def forget(rank: int, group: int | None = None) -> None:
    """Drop global rank ``rank``'s rings (a new world), or only that of ``group``."""
    with _lock:
        if group is None:
            _rings.pop(rank, None)
        else:
            _rings.get(rank, {}).pop(group, None)


def ranks() -> list[int]:
    """The global ranks this process holds rings of (one, unless ranks are threads)."""
    with _lock:
        return sorted(_rings)


# -- failures ----------------------------------------------------------------------------


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def summary(call) -> tuple:
    """What an Entry keeps of a Call once the op is over: its fingerprint, bytes, async flag
    and requested algorithm (not its buffers, which would stay alive with it)."""
    return (call.fingerprint, call.nbytes, call.async_op, call.algorithm)


def failed(entry: list, rank: int, exc: BaseException) -> None:
    """Op ``entry`` of global rank ``rank`` raised ``exc``: note it, and dump the rank if
    ``CHORUS_FLIGHT_RECORDER_DIR`` is set and ``exc`` is a chorus error."""
    entry[ENDED_AT] = clock()
    entry[STATE] = FAILED
    entry[ERROR] = (_error_text(exc), getattr(exc, "lost_rank", None))
    if type(entry[CALL]) is not tuple:
        entry[CALL] = summary(entry[CALL])
    on_error(rank, exc)


def run_lane(ring: Ring, log: list, seq: int, run, *args) -> None:
    """``run(seq, *args)``, latency-lane op ``seq`` of ``ring``: noted in the lane's
    ``log``, the clock read at times (:func:`tick`), a failure kept, the op marked done."""
    log.append(seq)
    if seq >= ring.clock_at:
        tick(ring, seq)
    try:
        run(seq, *args)
    except BaseException as exc:
        failed_lane(ring, seq, ring.members[ring.group_rank], exc)
        raise
    ring.done = seq


def failed_lane(ring: Ring, seq: int, rank: int, exc: BaseException) -> None:
    """Latency-lane op ``seq`` of ``ring`` raised ``exc`` (see :func:`failed`)."""
    if len(ring.errors) > 64:
        ring.errors.pop(min(ring.errors))
    ring.errors[seq] = (_error_text(exc), clock(), getattr(exc, "lost_rank", None))
    on_error(rank, exc)


def on_error(rank: int, exc: BaseException) -> None:
    """Dump ``rank`` into ``CHORUS_FLIGHT_RECORDER_DIR`` if it is set and ``exc`` is a
    chorus error about communication (not a bad argument)."""
    if not isinstance(exc, ChorusError) or isinstance(exc, (InvalidArgumentError, InvalidTensorError)):
        return
    directory = config.get("CHORUS_FLIGHT_RECORDER_DIR")
    if directory:
        try:
            dump(os.path.join(directory, f"rank{rank}.json"), rank, reason=_error_text(exc))
        except OSError:
            pass  # a dump must never hide the error itself


# -- the file ----------------------------------------------------------------------------

# Peers named by the errors of a wait (chorus.transport.handles.wait_all, chorus.shm.sync,
# monitored_barrier's gloo wording).
_WAITING = (re.compile(r"no answer from ranks \[([\d, ]*)\]"),
            re.compile(r"rank\(s\) \[([\d, ]*)\] did not arrive"),
            re.compile(r"Ranks? ([\d, ]*\d) failed to pass monitoredBarrier"))


def waiting_on(error: str) -> list[int]:
    """The ranks a failed wait names as silent in its error message."""
    for pattern in _WAITING:
        m = pattern.search(error)
        if m:
            return [int(x) for x in m.group(1).split(",") if x.strip()]
    return []


def decode(fp: int) -> dict:
    """The call a fingerprint encodes (chorus.wire.fingerprint): op, dtype, count, root,
    reduce op."""
    code, red, root = fp & 0x3F, (fp >> 11) & 0xF, (fp >> 15) & 0xFFFF
    return {"op": COLLECTIVES[code - 1] if 1 <= code <= len(COLLECTIVES) else "?",
            "dtype": dtype_name((fp >> 6) & 0x1F), "count": fp >> 31,
            "reduce_op": REDUCE_OPS[red - 1] if 1 <= red <= len(REDUCE_OPS) else "",
            "root": root - 1 if root else -1}


def _entry(seq: int, item, issued: float | None, ring: Ring) -> dict:
    if type(item) is list:  # the general path's Entry
        call = item[CALL]
        fp, nbytes, async_op, _ = call if type(call) is tuple else summary(call)
        error = item[ERROR]
        return {
            "seq": seq, **decode(fp), "nbytes": nbytes, "async": async_op, "component": item[COMPONENT],
            "algorithm": item[ALGORITHM], "lane": False, "state": item[STATE], "issued": item[ISSUED],
            "started": item[STARTED_AT] or None, "ended": item[ENDED_AT] or None, "timed": "exact",
            "error": error[0] if error else None, "lost_rank": error[1] if error else None,
            "waiting_on": waiting_on(error[0]) if error else [], "fingerprint": fp, "call": describe(fp),
        }
    plan = item[-1]  # a lane's plan key: (dtype, op or None, shape, plan) or (dtype, shape, plan)
    dtype = item[0]
    shape = item[2] if len(item) == 4 else item[1]
    count = 1
    for n in shape:
        count *= n
    failure = ring.errors.get(seq)
    state = FAILED if failure else DONE if seq <= ring.done else STARTED
    return {
        "seq": seq, "op": decode(plan.fingerprint)["op"], "dtype": dtype.name,
        "count": count, "nbytes": count * dtype.itemsize,
        "reduce_op": getattr(item[1], "name", "") if len(item) == 4 else "", "root": -1, "async": getattr(plan, "async_op", False),
        "component": getattr(plan, "component", "shm"), "algorithm": getattr(plan, "algorithm", "window"),
        "lane": True, "state": state, "issued": issued,
        "started": issued, "ended": failure[1] if failure else None, "timed": "sampled",
        "error": failure[0] if failure else None, "lost_rank": failure[2] if failure else None,
        "waiting_on": waiting_on(failure[0]) if failure else [],
        "fingerprint": plan.fingerprint, "call": describe(plan.fingerprint),
    }


def snapshot(rank: int, reason: str = "") -> dict:
    """Global rank ``rank``'s rings as the dump writes them (times in unix seconds)."""
    with _lock:
        rings = list(_rings.get(rank, {}).values())
    now, unix = clock(), time.time()

    def wall(t):
        return None if t is None else round(unix - (now - t), 6)

    groups = []
    for ring in rings:
        entries = ring.entries()
        for e in entries:
            for key in ("issued", "started", "ended"):
                e[key] = wall(e[key])
        groups.append({"id": ring.group, "name": ring.name, "members": list(ring.members),
                       "group_rank": ring.group_rank, "size": ring.size, "entries": entries})
    groups.sort(key=lambda g: g["id"])
    return {"version": VERSION, "rank": rank, "pid": os.getpid(), "host": socket.gethostname(),
            "reason": reason, "time": unix, "groups": groups}


_dump_lock = threading.Lock()


def dump(path: str, rank: int, reason: str = "requested") -> str:
    """Write global rank ``rank``'s flight recorder to ``path`` (JSON, replaced atomically);
    return the path."""
    data = snapshot(rank, reason)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with _dump_lock:
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, default=str)
        os.replace(tmp, path)
    return path


def dump_flight_recorder(path: str | None = None, rank: int | None = None) -> str:
    """Write this rank's flight recorder (the last ``CHORUS_FLIGHT_RECORDER_SIZE`` ops of
    every group) to ``path`` as JSON and return the path.

    ``path`` defaults to ``$CHORUS_FLIGHT_RECORDER_DIR/rank<N>.json``.  ``rank`` (global)
    is needed only when ranks run as threads of one process (chorus.testing)."""
    if rank is None:
        held = ranks()
        if len(held) != 1:
            raise InvalidArgumentError(
                "dump_flight_recorder: this process holds the flight recorders of "
                f"{'no rank (no collective ran yet)' if not held else f'ranks {held}'}; pass rank=")
        rank = held[0]
    if path is None:
        directory = config.get("CHORUS_FLIGHT_RECORDER_DIR")
        if not directory:
            raise InvalidArgumentError("dump_flight_recorder: pass a path or set CHORUS_FLIGHT_RECORDER_DIR")
        path = os.path.join(directory, f"rank{rank}.json")
    return dump(path, rank)


# -- signals -----------------------------------------------------------------------------

_installed: dict[int, object] = {}


def install_signal_dumps(rank: int) -> bool:
    """With ``CHORUS_FLIGHT_RECORDER_DIR`` set, make SIGTERM and SIGINT (a launcher stopping
    the job, Ctrl-C) first write ``DIR/rank<rank>.json``, then do what they did before
    (the previous handler, or the default action).  Only from the main thread; True if
    installed."""
    directory = config.get("CHORUS_FLIGHT_RECORDER_DIR")
    if not directory or threading.current_thread() is not threading.main_thread():
        return False
    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = _installed.get(signum, signal.getsignal(signum))
        _installed[signum] = previous
        signal.signal(signum, _handler(rank, directory, previous))
    return True


def _handler(rank: int, directory: str, previous):
    def on_signal(signum, frame):
        try:
            dump(os.path.join(directory, f"rank{rank}.json"), rank, reason=f"signal {signal.Signals(signum).name}")
        except OSError:
            pass
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # SIG_DFL (or unknown): die of the signal as before
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    return on_signal
