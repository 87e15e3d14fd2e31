"""Traces: ``CHORUS_TRACE=PREFIX`` makes every rank write ``PREFIX.rank<N>.json``.

The file is in the Chrome trace event format (chrome://tracing, https://ui.perfetto.dev):
one track per group of the rank; on it, one span per op (``cat: "op"``: the collective,
its sequence number, component, algorithm and call) and, inside it, one span per transfer
or phase that the components report (``cat: "transfer"``: send, recv, sync, copy, reduce,
phase — with bytes and peer); a split all_reduce's parts (chorus.components.channels) on a
track per channel.  It is a recorder listener (chorus.recorder): while it is
attached every op takes the general path (the shared-memory latency lanes step aside), so
tracing costs time, as it may.

Clocks: times are this process's ``time.perf_counter``.  At init every rank measures its
clock's offset to rank 0's through the store (a few ping-pongs; the one with the shortest
round trip counts) and records it in ``otherData``: ``clock_offset_us`` (add it to this
file's times to get rank 0's), ``clock_rtt_us`` (its uncertainty) and ``boot_id`` (ranks
of one boot share one monotonic clock: their offset is exactly 0).
``chorus trace merge PREFIX -o job.json`` shifts every rank's file onto rank 0's clock
and writes one timeline, one process per rank.

The file is written when the rank leaves (destroy_process_group) or exits; a rank
killed by a signal writes none.  Ranks that run as threads of one process (chorus.testing)
share one listener: trace real processes.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import threading
import time

from chorus import config, recorder
from chorus.recorder import Event
from chorus.wire.fingerprint import describe

__all__ = ["Tracer", "chrome_events", "load", "main", "measure_offset", "merge", "start", "stop"]

VERSION = 1
PING_ROUNDS = 5


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def measure_offset(store, rank: int, world_size: int, rounds: int = PING_ROUNDS) -> tuple[float, float]:
    """``(offset, rtt)`` in seconds: rank 0's perf_counter minus this rank's, from the
    ping-pong through ``store`` with the shortest round trip (rank 0 answers every other
    rank in turn; every rank calls this)."""
    if rank == 0:
        for peer in range(1, world_size):
            for k in range(rounds):
                store.get(f"ping/{peer}/{k}")
                store.set(f"pong/{peer}/{k}", repr(time.perf_counter()))
        return 0.0, 0.0
    best = (0.0, float("inf"))
    for k in range(rounds):
        t0 = time.perf_counter()
        store.set(f"ping/{rank}/{k}", b"1")
        theirs = float(store.get(f"pong/{rank}/{k}"))
        t1 = time.perf_counter()
        if t1 - t0 < best[1]:
            best = (theirs - (t0 + t1) / 2, t1 - t0)
    return best


class Tracer:
    """The listener: keeps every event of this process, writes them at ``write()``."""

    def __init__(self, prefix: str, rank: int, world_size: int, offset: float = 0.0, rtt: float = 0.0):
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.offset = offset
        self.rtt = rtt
        self.events: list[Event] = []
        self.names: dict[int, str] = {}  # group id -> name, when known
        self.written: str | None = None

    def __call__(self, event: Event) -> None:
        self.events.append(event)  # list.append is atomic: ops of several groups may report at once

    @property
    def path(self) -> str:
        return f"{self.prefix}.rank{self.rank}.json"

    def document(self) -> dict:
        return {"traceEvents": chrome_events(list(self.events), self.rank, self.names),
                "displayTimeUnit": "ns",
                "otherData": {"chorus_trace": VERSION, "rank": self.rank, "world_size": self.world_size,
                              "clock": "perf_counter", "clock_offset_us": self.offset * 1e6,
                              "clock_rtt_us": self.rtt * 1e6, "boot_id": _boot_id(),
                              "pid": os.getpid()}}

    def write(self) -> str:
        """Write ``PREFIX.rank<N>.json`` (again, if events came since); return its path."""
        path = self.path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.document(), f)
        os.replace(tmp, path)
        self.written = path
        return path


def chrome_events(events: list[Event], rank: int, names: dict[int, str] | None = None) -> list[dict]:
    """Chrome trace events of one rank's recorder events: metadata (process and track
    names), one ``X`` span per op (begin .. end) and one per transfer or phase.  The
    transfers of a split op's parts (chorus.components.channels) go on a track per
    channel, "group G channel K", with ``group`` and ``channel`` in their args."""
    names = names or {}
    out: list[dict] = [{"ph": "M", "pid": rank, "tid": 0, "name": "process_name", "args": {"name": f"rank {rank}"}},
                       {"ph": "M", "pid": rank, "tid": 0, "name": "process_sort_index", "args": {"sort_index": rank}}]
    groups: set[int] = set()
    parts = sorted({(e.group, e.detail["channel"]) for e in events if "channel" in e.detail})
    first = max((e.group for e in events), default=0) + 1  # channel tracks after every group's
    tracks = {part: first + i for i, part in enumerate(parts)}
    begun: dict[tuple[int, int], Event] = {}
    for e in events:
        groups.add(e.group)
        if e.what == "begin":
            begun[(e.group, e.seq)] = e
        elif e.what == "end":
            b = begun.pop((e.group, e.seq), None)
            if b is None:
                continue
            args = {"seq": e.seq, "component": b.component, "algorithm": b.algorithm, "call": describe(e.fingerprint)}
            args.update({k: str(v) for k, v in b.detail.items()})
            if "error" in e.detail:
                args["error"] = str(e.detail["error"])
            out.append({"ph": "X", "pid": rank, "tid": e.group, "cat": "op", "name": e.op,
                        "ts": b.start * 1e6, "dur": max(0.0, (e.end - b.start) * 1e6), "args": args})
        else:
            args = {"op": e.op, "seq": e.seq, "bytes": e.nbytes, "component": e.component}
            if e.peer >= 0:
                args["peer"] = e.peer
            if e.algorithm:
                args["algorithm"] = e.algorithm
            args.update({k: str(v) for k, v in e.detail.items()})
            tid = e.group
            if "channel" in e.detail:
                args.update(group=e.group, channel=e.detail["channel"])
                tid = tracks[(e.group, e.detail["channel"])]
            name = e.what if e.peer < 0 else f"{e.what} {'->' if e.what == 'send' else '<-'} {e.peer}"
            out.append({"ph": "X", "pid": rank, "tid": tid, "cat": "transfer", "name": name,
                        "ts": e.start * 1e6, "dur": max(0.0, (e.end - e.start) * 1e6), "args": args})
    for g in sorted(groups):
        out.append({"ph": "M", "pid": rank, "tid": g, "name": "thread_name",
                    "args": {"name": f"group {names.get(g, g)}"}})
    for (g, k), tid in tracks.items():
        out.append({"ph": "M", "pid": rank, "tid": tid, "name": "thread_name",
                    "args": {"name": f"group {names.get(g, g)} channel {k}"}})
    # by start, the enclosing (longer) span first: viewers nest spans in that order
    out.sort(key=lambda x: (x["ph"] != "M", x.get("ts", 0.0), -x.get("dur", 0.0)))
    return out


# -- the process's tracer -------------------------------------------------------------------

_tracer: Tracer | None = None
_lock = threading.Lock()


def start(rank: int, world_size: int, store=None) -> Tracer | None:
    """With ``CHORUS_TRACE`` set, measure this rank's clock offset through ``store`` (every
    rank calls this at init), attach a :class:`Tracer` and return it; else None."""
    global _tracer
    prefix = config.get("CHORUS_TRACE")
    if not prefix:
        return None
    offset, rtt = measure_offset(store, rank, world_size) if store is not None and world_size > 1 else (0.0, 0.0)
    with _lock:
        if _tracer is not None:
            _write_quietly(_tracer)
        _tracer = Tracer(prefix, rank, world_size, offset, rtt)
        recorder.attach(_tracer)
    atexit.register(stop)
    return _tracer


def stop(names: dict[int, str] | None = None) -> str | None:
    """Detach this process's tracer and write its file (``names``: group id -> name, for
    the tracks); the path, or None if none ran."""
    global _tracer
    with _lock:
        tracer, _tracer = _tracer, None
    if tracer is None:
        return None
    tracer.names.update(names or {})
    if recorder.current is tracer:
        recorder.detach()
    return _write_quietly(tracer)


def _write_quietly(tracer: Tracer) -> str | None:
    try:
        return tracer.write()
    except OSError as exc:
        print(f"chorus: could not write the trace {tracer.path}: {exc}", file=sys.stderr)
        return None


# -- reading and merging ----------------------------------------------------------------------

_RANK_FILE = re.compile(r"\.rank(\d+)\.json$")


def load(path: str) -> dict:
    """A trace file (one rank's or a merged one)."""
    with open(path) as f:
        return json.load(f)


def rank_files(prefix: str) -> dict[int, str]:
    """rank -> ``PREFIX.rank<N>.json``, for every such file."""
    import glob

    found = {}
    for path in glob.glob(glob.escape(prefix) + ".rank*.json"):
        m = _RANK_FILE.search(path)
        if m:
            found[int(m.group(1))] = path
    return dict(sorted(found.items()))


def merge(prefix: str) -> dict:
    """Every rank's file of ``prefix`` on rank 0's clock, as one trace starting at 0: ranks
    of rank 0's boot keep their times (one monotonic clock), others shift by their
    measured offset."""
    files = rank_files(prefix)
    if not files:
        raise FileNotFoundError(f"no trace files {prefix}.rank<N>.json")
    docs = {rank: load(path) for rank, path in files.items()}
    base_boot = docs.get(0, next(iter(docs.values())))["otherData"].get("boot_id")
    shifts, clocks = {}, {}
    for rank, doc in docs.items():
        other = doc["otherData"]
        same = base_boot and other.get("boot_id") == base_boot
        shifts[rank] = 0.0 if same else other.get("clock_offset_us", 0.0)
        clocks[rank] = {"offset_us": shifts[rank], "measured_offset_us": other.get("clock_offset_us", 0.0),
                        "rtt_us": other.get("clock_rtt_us", 0.0), "same_clock_as_rank0": bool(same)}
    spans = [(rank, e) for rank, doc in docs.items() for e in doc["traceEvents"]]
    origin = min((e["ts"] + shifts[rank] for rank, e in spans if "ts" in e), default=0.0)
    events = []
    for rank, e in spans:
        e = dict(e)
        if "ts" in e:
            e["ts"] = round(e["ts"] + shifts[rank] - origin, 3)
        events.append(e)
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"chorus_trace": VERSION, "merged": sorted(docs), "clocks": clocks,
                          "world_size": max(d["otherData"].get("world_size", 0) for d in docs.values())}}


def main(argv: list[str] | None = None) -> int:
    """``chorus trace merge PREFIX -o job.json``."""
    import argparse

    p = argparse.ArgumentParser(prog="chorus trace", description="Work with CHORUS_TRACE files.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="align every rank's PREFIX.rank<N>.json on rank 0's clock, one timeline",
                       description="Read PREFIX.rank<N>.json of every rank, shift each onto rank 0's clock "
                                   "(the offsets measured at init) and write one Chrome trace / Perfetto file.")
    m.add_argument("prefix", help="the CHORUS_TRACE value of the job")
    m.add_argument("-o", "--output", default=None, help="where to write it (default: PREFIX.json)")
    args = p.parse_args(argv)
    try:
        doc = merge(args.prefix)
    except FileNotFoundError as exc:
        print(f"chorus trace merge: {exc}", file=sys.stderr)
        return 1
    out = args.output or f"{args.prefix}.json"
    with open(out, "w") as f:
        json.dump(doc, f)
    ranks = doc["otherData"]["merged"]
    offsets = ", ".join(f"rank {r}: {c['offset_us']:+.1f} us" for r, c in doc["otherData"]["clocks"].items())
    print(f"chorus trace merge: {len(ranks)} rank(s) -> {out} ({offsets})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
