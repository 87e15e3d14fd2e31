"""The flight recorder: every group keeps its last N ops, always, for a few stores per op.

When a job hangs or fails, what each rank was doing — which op it had reached, which it
was waiting in and for whom — is what tells the cause.  Each group holds a :class:`Ring`
of N slots (``CHORUS_FLIGHT_RECORDER_SIZE``, default 2000; 0 turns it off), made at the
group's first op; op ``seq`` goes to slot ``seq % N``::

    seqs[i]    its sequence number
    times[i]   when it was issued (time.perf_counter)
    ops[i]     what it is:
               - an Entry (a list, see ``NAME`` .. ``ERROR``) for an op of the general path,
                 written by chorus.components.base.run_in_order: the call's fields, the
                 component and algorithm, state (queued, started, done, failed), times and
                 the error
               - the plan key of the shared-memory latency lanes (chorus.components.shm:
                 ``(dtype, op, shape, plan)`` for all_reduce, ``(dtype, shape, plan)`` for
                 all_to_all): the lane stores that tuple, the time and the sequence number,
                 and ``ring.done = seq`` when the op returns; a lane op that raises is noted
                 in ``ring.errors``

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
                              "ended": null, "error": "CommTimeoutError: ...",
                              "waiting_on": [2], "lost_rank": null, "call": "all_reduce(...)"},
                             ...]}]}
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time

from chorus import config
from chorus.errors import ChorusError, InvalidArgumentError, InvalidTensorError
from chorus.wire.fingerprint import describe

__all__ = ["Ring", "attach", "dump", "dump_flight_recorder", "failed", "failed_lane", "forget",
           "install_signal_dumps", "snapshot"]

clock = time.perf_counter

QUEUED, STARTED, DONE, FAILED = "queued", "started", "done", "failed"
# An Entry's fields (a list: its state and times change as the op runs).
NAME, FIELDS, COMPONENT, ALGORITHM, STATE, STARTED_AT, ENDED_AT, ERROR = range(8)
# FIELDS is ``call[3:14]``: these fields of chorus.call.Call (never its buffers or hooks,
# which would keep the caller's arrays alive).
_DTYPE, _COUNT, _NBYTES, _ARGS, _REDUCE_OP, _ROOT, _ASYNC, _ASKED, _UNIFORM, _SEQ, _FP = range(11)
CALL_FIELDS = slice(3, 14)

VERSION = 1


class Ring:
    """The last ``size`` ops of one group on this rank (see the module docstring)."""

    __slots__ = ("group", "name", "members", "group_rank", "size", "ops", "seqs", "times", "done",
                 "errors")

    def __init__(self, group: int, name: str, members: tuple[int, ...], group_rank: int, size: int):
        self.group = group
        self.name = name
        self.members = members
        self.group_rank = group_rank
        self.size = size
        self.ops: list = [None] * size
        self.seqs: list[int] = [-1] * size
        self.times: list[float] = [0.0] * size
        self.done = -1  # the latest lane op that returned
        self.errors: dict[int, tuple[str, float, int | None]] = {}  # lane seq -> (error, time, lost rank)

    def enter(self, call, component: str, algorithm: str) -> list:
        """Note ``call`` (a chorus.call.Call) as queued; its Entry, which the runner updates."""
        entry = [call.name, call[CALL_FIELDS], component, algorithm, QUEUED, 0.0, 0.0, None]
        seq = call.seq
        i = seq % self.size
        self.ops[i] = entry
        self.seqs[i] = seq
        self.times[i] = clock()
        return entry

    def entries(self) -> list[dict]:
        """Every op held, oldest first, as the dump writes them (times: perf_counter)."""
        out = []
        for i in range(self.size):
            seq, op = self.seqs[i], self.ops[i]
            if seq < 0 or op is None:
                continue
            out.append(_entry(seq, op, self.times[i], self))
        out.sort(key=lambda e: e["seq"])
        return out


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


def failed(entry: list, rank: int, exc: BaseException) -> None:
    """Op ``entry`` of global rank ``rank`` raised ``exc``: note it, and dump the rank if
    ``CHORUS_FLIGHT_RECORDER_DIR`` is set and ``exc`` is a chorus error."""
    entry[ENDED_AT] = clock()
    entry[STATE] = FAILED
    entry[ERROR] = (_error_text(exc), getattr(exc, "lost_rank", None))
    on_error(rank, exc)


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

# Peers named by the errors of a wait (chorus.transport.handles.wait_all, chorus.shm.sync).
_WAITING = (re.compile(r"no answer from ranks \[([\d, ]*)\]"),
            re.compile(r"rank\(s\) \[([\d, ]*)\] did not arrive"))


def waiting_on(error: str) -> list[int]:
    """The ranks a failed wait names as silent in its error message."""
    for pattern in _WAITING:
        m = pattern.search(error)
        if m:
            return [int(x) for x in m.group(1).split(",") if x.strip()]
    return []


def _entry(seq: int, op, issued: float, ring: Ring) -> dict:
    if type(op) is list:  # the general path's Entry
        f = op[FIELDS]
        error = op[ERROR]
        return {
            "seq": seq, "op": op[NAME], "dtype": f[_DTYPE], "count": f[_COUNT], "nbytes": f[_NBYTES],
            "reduce_op": f[_REDUCE_OP], "root": f[_ROOT], "async": f[_ASYNC], "component": op[COMPONENT],
            "algorithm": op[ALGORITHM], "lane": False, "state": op[STATE], "issued": issued,
            "started": op[STARTED_AT] or None, "ended": op[ENDED_AT] or None,
            "error": error[0] if error else None, "lost_rank": error[1] if error else None,
            "waiting_on": waiting_on(error[0]) if error else [],
            "fingerprint": f[_FP], "call": describe(f[_FP]),
        }
    plan = op[-1]  # a lane's plan key: (dtype, op, shape, plan) or (dtype, shape, plan)
    dtype = op[0]
    shape = op[2] if len(op) == 4 else op[1]
    count = 1
    for n in shape:
        count *= n
    failure = ring.errors.get(seq)
    state = FAILED if failure else DONE if seq <= ring.done else STARTED
    return {
        "seq": seq, "op": "all_reduce" if len(op) == 4 else "all_to_all", "dtype": dtype.name,
        "count": count, "nbytes": count * dtype.itemsize,
        "reduce_op": op[1].name if len(op) == 4 else "", "root": -1, "async": False,
        "component": "shm", "algorithm": "window", "lane": True, "state": state, "issued": issued,
        "started": issued, "ended": failure[1] if failure else None,
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
