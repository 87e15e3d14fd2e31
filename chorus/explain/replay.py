"""``chorus explain --trace job.json``: a traced run (chorus.trace) replayed as a walkthrough.

The trace says which ops ran (collective, call, component, algorithm) and, for each rank,
the transfers of each step with their times.  The op chosen (``--op SEQ``, by default the
first one with transfers) is walked through with the algorithm the trace names — the
same schedules, the same sizes — and each step carries the times measured on every rank
that finished a step of its own there; the transfers are compared with the schedule's
(peers and bytes).  Shared-memory ops are shown as their phases with the op's times
(their inner events appear in traces once the component reports them).
"""

from __future__ import annotations

import re
from collections import defaultdict

from chorus.explain.shm import shm_walk
from chorus.explain.walk import Walkthrough, arguments, schedule_walk
from chorus.schedules.base import Recv, Send
from chorus.schedules.chunks import split as chunk_split
from chorus.schedules.registry import ALGORITHMS
from chorus.schedules.registry import algorithm as find_algorithm
from chorus.trace import load

_CALL = re.compile(r"^(\w+)\((\w+), count=(\d+)(?:, root=(\d+))?")
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
            "int32": 4, "int64": 8, "bool": 1, "complex64": 8, "complex128": 16, "bytes": 1}


class TracedOp:
    """One op of the trace: its spans per rank and their transfers."""

    def __init__(self, group: int, seq: int):
        self.group, self.seq = group, seq
        self.spans: dict[int, dict] = {}  # rank -> the op's span
        self.transfers: dict[int, list[dict]] = defaultdict(list)  # rank -> transfer spans

    @property
    def first(self) -> dict:
        return next(iter(self.spans.values()))

    def describe(self) -> str:
        a = self.first["args"]
        times = ", ".join(f"rank {r} {s['dur']:.0f} us" for r, s in sorted(self.spans.items()))
        return (f"group {self.group} #{self.seq} {a.get('call', self.first['name'])} "
                f"[{a.get('component')}/{a.get('algorithm')}]: {times}")


def ops_of(doc: dict) -> list[TracedOp]:
    """Every op of a trace document (merged, or one rank's), in order."""
    ops: dict[tuple[int, int], TracedOp] = {}
    for e in doc["traceEvents"]:
        if e.get("ph") != "X":
            continue
        seq = e["args"].get("seq")
        key = (e["tid"], seq)
        if e.get("cat") == "op":
            ops.setdefault(key, TracedOp(*key)).spans[e["pid"]] = e
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "transfer":
            a = e["args"]
            group = a["group"] if "channel" in a else e["tid"]  # (a channel's track names its group)
            op = ops.get((group, a.get("seq")))
            if op is not None:
                op.transfers[e["pid"]].append(e)
    return [ops[k] for k in sorted(ops)]


def replay(path: str, seq: int | None = None, group: int = 0) -> tuple[Walkthrough, list[str]]:
    """(the walkthrough of the chosen op, the list of the trace's ops as text)."""
    doc = load(path)
    ops = [op for op in ops_of(doc) if op.group == group] or ops_of(doc)
    if not ops:
        raise ValueError(f"{path}: no op spans (is it a CHORUS_TRACE file?)")
    listing = [op.describe() for op in ops]
    if seq is None:
        chosen = next((op for op in ops if op.transfers), ops[0])
    else:
        chosen = next((op for op in ops if op.seq == seq), None)
        if chosen is None:
            raise ValueError(f"{path}: no op #{seq} in group {ops[0].group}; the trace has "
                             f"#{', #'.join(str(op.seq) for op in ops)}")
    world = doc["otherData"].get("world_size") or len(chosen.spans)
    return _walk(chosen, world), listing


def _walk(op: TracedOp, world: int) -> Walkthrough:
    args = op.first["args"]
    m = _CALL.match(args.get("call", ""))
    if not m:
        raise ValueError(f"op #{op.seq}: cannot read its call {args.get('call')!r}")
    name, dtype, count, root = m.group(1), m.group(2), int(m.group(3)), int(m.group(4) or 0)
    itemsize = ITEMSIZE.get(dtype, 4)
    algorithm = args.get("algorithm", "")
    if name == "reduce_scatter":
        count *= world  # the call counts one rank's block; the schedule its whole input
    if name == "all_to_all" and op.transfers:
        count = max(t["args"]["bytes"] for ts in op.transfers.values() for t in ts) // itemsize
    split = {t["args"]["channel"] for ts in op.transfers.values() for t in ts if "channel" in t["args"]}
    if split:  # each part ran the algorithm on its slice: part 0's (chorus.components.channels)
        count = chunk_split(count, len(split))[0]
    if args.get("component") != "shm" and algorithm in ALGORITHMS.get(name, {}):
        walk = schedule_walk(name, algorithm, world, count, root=root, itemsize=itemsize)
        if split:
            op.transfers = {r: [t for t in ts if t["args"].get("channel") == 0] for r, ts in op.transfers.items()}
        _annotate(walk, op, name, algorithm, world, count, root)
        if split:
            walk.footer.insert(0, f"split into {len(split)} parts, one per channel, each this algorithm on "
                                  "its slice of the data: part 0's steps, sizes and times")
    else:
        variant = "shm:one_shot" if name in ("all_reduce", "reduce") and count * itemsize * (world - 1) <= 256 << 10 \
            else "shm:rs_ag" if name in ("all_reduce", "reduce") else "shm:window"
        walk = shm_walk(name, variant, world, count, root=root, itemsize=itemsize)
        walk.footer.append(f"traced as {args.get('component')}/{algorithm}; shown as {variant} (the variant "
                           "chorus picks for this size with default settings)")
    times = ", ".join(f"rank {r}: {s['dur']:.1f} us" for r, s in sorted(op.spans.items()))
    walk.footer.insert(0, f"replayed from the trace: op #{op.seq} of group {op.group}, {args.get('call')}; "
                          f"measured op time {times}")
    return walk


def _annotate(walk: Walkthrough, op: TracedOp, name: str, algorithm: str, world: int, count: int,
              root: int) -> None:
    """Each step's note: the measured time of the ranks' schedule steps that ended in it;
    a footer line saying whether the traced transfers are the schedule's."""
    fn = find_algorithm(name, algorithm)
    kw = arguments(name, world, count, root)
    measured: dict[int, dict[int, float]] = {}  # rank -> schedule step -> microseconds
    agree = True
    for r in range(world):
        steps = fn(r, world, **kw).steps
        moving = [i for i, step in enumerate(steps) if any(isinstance(o, (Send, Recv)) for o in step)]
        by_start: dict[float, list[dict]] = defaultdict(list)
        for t in op.transfers.get(r, ()):
            by_start[t["ts"]].append(t)
        traced = [by_start[ts] for ts in sorted(by_start)]
        if r in op.transfers and len(traced) != len(moving):
            agree = False
        measured[r] = {}
        for i, spans in zip(moving, traced, strict=False):
            measured[r][i] = max(s["dur"] for s in spans)
            want = sorted((("send" if isinstance(o, Send) else "recv"), o.peer)
                          for o in steps[i] if isinstance(o, (Send, Recv)))
            got = sorted((s["name"].split()[0], s["args"].get("peer")) for s in spans)
            agree &= [w[0] for w in want] == [g[0] for g in got]
    for step in walk.steps:
        times = [f"rank {r} {measured[r][i]:.1f} us" for r, i in sorted(step.ends.items())
                 if i in measured.get(r, {})]
        if times:
            step.note = "measured: " + ", ".join(times)
    if op.transfers:
        walk.footer.insert(0, "the traced transfers are the schedule's, step by step" if agree else
                           "the traced transfers differ from this schedule's (another size or algorithm?)")
