"""``chorus analyze DIR``: what the flight recorders of a failed or hung job say.

Reads every ``rank<N>.json`` in DIR (chorus.debug.flight writes them) and, group by group,
lines up the ranks' ops by sequence number.  Collectives of a group run in one order on
every rank, so op #k of one rank must be op #k of every other; from that it tells:

* **mismatch**: ranks that called different collectives (or dtypes, counts, roots,
  reduce ops) as the same op #k — shown side by side;
* **behind**: the lowest op some rank started and never finished is the op the job is
  stuck in; ranks that never issued it are behind (their last op is shown), and the ranks
  inside it were waiting for them (the peers their errors name);
* **no dump**: a member that wrote no file (killed, or stopped before it could) — what its
  peers last saw of it: the last op they completed (a collective completes only once every
  member joined it), the op they were in, and the error that named it (a lost peer);
* **failed**: errors the dumps hold that none of the above explains.

``analyze(directory)`` returns a :class:`Report` (its ``findings`` and ``text``);
``main`` prints the text and exits 1 when it found a problem, 0 when every dump is clean,
2 when there is nothing to read.  chorusrun prints ``summary(DIR)`` when a job fails and
``CHORUS_FLIGHT_RECORDER_DIR`` is set.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["Finding", "Report", "analyze", "load", "main", "summary"]

_RANK_FILE = re.compile(r"rank(\d+)\.json$")
# one clause of a CollectiveMismatchError: "ranks [0, 2-4] called all_reduce(...) as op #5"
_MISMATCH = re.compile(r"ranks? \[?([\d, -]+?)\]? (?:called|ran) (.+?) (?:as op #|\(op #)(\d+)")


@dataclass
class Finding:
    """One problem: ``kind`` (mismatch, behind, no_dump, failed), the group's name, the op's
    sequence number, the ranks it is about, and what to say."""

    kind: str
    group: str
    seq: int | None
    ranks: list[int]
    text: str


@dataclass
class Report:
    """What :func:`analyze` found: ``findings`` (root causes first) and the ``text`` it prints."""

    directory: str
    ranks: list[int] = field(default_factory=list)  # ranks that left a dump
    world: list[int] = field(default_factory=list)  # every rank the dumps name
    findings: list[Finding] = field(default_factory=list)
    text: str = ""

    @property
    def problem(self) -> bool:
        return bool(self.findings)


def load(directory: str, since: float | None = None) -> dict[int, dict]:
    """rank -> its dump, for every ``rank<N>.json`` in ``directory`` that parses (and was
    written at or after unix time ``since``, when given: a launcher ignores older jobs')."""
    dumps = {}
    for path in glob.glob(os.path.join(directory, "rank*.json")):
        m = _RANK_FILE.search(os.path.basename(path))
        if not m:
            continue
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if since is not None and data.get("time", 0) < since:
            continue
        dumps[int(data.get("rank", m.group(1)))] = data
    return dumps


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _call(e: dict) -> str:
    return f"#{e['seq']} {e.get('call') or e['op']}"


def _short(error: str | None, limit: int = 160) -> str:
    if not error:
        return ""
    error = " ".join(error.split())
    return error if len(error) <= limit else error[:limit - 3] + "..."


class _Group:
    """One group as every dumping rank saw it."""

    def __init__(self, gid: int, name: str, members: list[int]):
        self.id, self.name, self.members = gid, name, members
        self.ops: dict[int, dict[int, dict]] = {}  # rank -> seq -> entry
        self.kept: dict[int, int] = {}  # rank -> ring size

    def label(self) -> str:
        return f"group {self.name}" if self.name == str(self.id) else f"group {self.name} (id {self.id})"


def _groups(dumps: dict[int, dict]) -> list[_Group]:
    groups: dict[int, _Group] = {}
    for rank, data in sorted(dumps.items()):
        for g in data.get("groups", ()):
            group = groups.setdefault(g["id"], _Group(g["id"], g.get("name", str(g["id"])), list(g["members"])))
            group.ops[rank] = {e["seq"]: e for e in g.get("entries", ())}
            group.kept[rank] = g.get("size", 0)
    return [groups[k] for k in sorted(groups)]


def analyze(directory: str, since: float | None = None) -> Report:
    """Read the dumps in ``directory`` (written since unix time ``since``, if given) and say
    what went wrong (see the module docstring)."""
    dumps = load(directory, since)
    report = Report(directory, ranks=sorted(dumps))
    if not dumps:
        report.text = f"chorus analyze: no flight recorder dumps (rank<N>.json) in {directory}\n"
        return report
    groups = _groups(dumps)
    world = sorted({m for g in groups for m in g.members} | set(dumps))
    report.world = world
    lines = [f"chorus analyze: {len(dumps)} dump(s) in {directory} ({_ranks(dumps)}; the groups "
             f"name {len(world)} rank(s))"]
    for rank, data in sorted(dumps.items()):
        lines.append(f"  rank {rank}: {data.get('host', '?')} pid {data.get('pid', '?')}, dumped on "
                     f"{_short(data.get('reason'), 100) or 'request'}")
    missing = [r for r in world if r not in dumps]
    explained: set[int] = set()  # ranks whose missing dump a group's findings explain
    for group in groups:
        if not any(group.ops.get(r) for r in group.ops):
            continue
        found = _analyze_group(group, dumps, report, explained)
        lines.append("")
        lines.append(f"{group.label()}, {_ranks(group.members)}:")
        lines.extend(found or ["  every rank finished every op it issued; nothing wrong here"])
    for rank in missing:
        if rank not in explained:
            text = (f"rank {rank} left no dump and no group's ops say more about it (was it started? "
                    "killed before its first op?)")
            report.findings.append(Finding("no_dump", "", None, [rank], text))
            lines += ["", text]
    lines.append("")
    lines.append(_diagnosis(report))
    report.text = "\n".join(lines) + "\n"
    return report


def _analyze_group(group: _Group, dumps: dict[int, dict], report: Report, explained: set[int]) -> list[str]:
    lines: list[str] = []
    present = [r for r in group.members if r in group.ops]
    absent = [r for r in group.members if r not in group.ops]
    # -- mismatches: one op number, several calls ------------------------------------------
    seqs = sorted({s for r in present for s in group.ops[r]})
    mismatched = None
    for seq in seqs:
        calls = defaultdict(list)
        for r in present:
            e = group.ops[r].get(seq)
            if e is not None:
                calls[e.get("call") or e["op"]].append(r)
        if len(calls) > 1:
            mismatched = seq
            break
    told = _told_mismatch(group, present, mismatched)
    if mismatched is None and told is not None:
        mismatched = told[0]
    if mismatched is not None:
        lines += _mismatch(group, present, mismatched, told, report)
    # -- the op the group is stuck in ---------------------------------------------------------
    unfinished = [e["seq"] for r in present for e in group.ops[r].values() if e["state"] != "done"]
    stuck = min(unfinished) if unfinished else None
    if stuck is not None and stuck != mismatched:
        lines += _stuck(group, present, stuck, dumps, report)
    # -- members without a dump ---------------------------------------------------------------
    for rank in absent:
        lines += _absent(group, present, rank, stuck, report)
        explained.add(rank)
    # -- errors nothing above explains --------------------------------------------------------
    if not report.findings or all(f.group != group.name for f in report.findings):
        for r in present:
            for e in group.ops[r].values():
                if e["state"] == "failed":
                    text = f"rank {r}: op {_call(e)} failed: {_short(e.get('error'))}"
                    report.findings.append(Finding("failed", group.name, e["seq"], [r], text))
                    lines.append("  " + text)
                    break
    return lines


def _told_mismatch(group: _Group, present: list[int], seq: int | None):
    """(seq, {rank: its call}) from the first CollectiveMismatchError in the dumps, if any."""
    for r in present:
        for e in sorted(group.ops[r].values(), key=lambda e: e["seq"]):
            error = e.get("error") or ""
            if error.startswith("CollectiveMismatchError"):
                clauses = _MISMATCH.findall(error)
                if clauses:
                    calls = {rank: call for ranks, call, _ in clauses for rank in _rank_list(ranks)}
                    return int(clauses[0][2]), calls
    return None


def _rank_list(text: str) -> list[int]:
    """[0, 2, 3, 4] for "0, 2-4"."""
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def _mismatch(group: _Group, present: list[int], seq: int, told, report: Report) -> list[str]:
    calls: dict[str, list[int]] = defaultdict(list)
    for r in present:
        e = group.ops[r].get(seq)
        if e is not None:
            calls[e.get("call") or e["op"]].append(r)
    if told is not None and told[0] == seq:
        for rank, call in sorted(told[1].items()):
            if rank not in present:
                calls[call + " (as a peer's error reports)"].append(rank)
    majority = max(calls.values(), key=len) if calls else []
    odd = sorted(r for ranks in calls.values() if ranks is not majority for r in ranks)
    lines = [f"  MISMATCH at op #{seq}: the ranks called different collectives"]
    for call, ranks in sorted(calls.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"    {_ranks(ranks):<16} {call}")
    lines += _side_by_side(group, present, seq)
    text = (f"{group.label()}: op #{seq} is a mismatch: "
            + "; ".join(f"{_ranks(r)} called {c}" for c, r in sorted(calls.items(), key=lambda kv: -len(kv[1]))))
    report.findings.append(Finding("mismatch", group.name, seq, odd or sorted(r for v in calls.values() for r in v),
                                   text))
    return lines


def _side_by_side(group: _Group, present: list[int], seq: int) -> list[str]:
    """Ops seq-2 .. seq+1 of every dumping rank, one column per rank."""
    table = [["op", *(f"rank {r}" for r in present)]]
    for s in range(max(0, seq - 2), seq + 2):
        cells = []
        for r in present:
            e = group.ops[r].get(s)
            cells.append("-" if e is None else f"{e['op']}({e['dtype']},{e['count']}) {e['state']}")
        if any(c != "-" for c in cells):
            table.append([f"#{s}", *cells])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["    " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]


def _last_done(ops: dict[int, dict]) -> dict | None:
    done = [e for e in ops.values() if e["state"] == "done"]
    return max(done, key=lambda e: e["seq"]) if done else None


def _stuck(group: _Group, present: list[int], seq: int, dumps: dict[int, dict], report: Report) -> list[str]:
    inside = [r for r in present if seq in group.ops[r]]
    behind = [r for r in present if seq not in group.ops[r]
              and (not group.ops[r] or max(group.ops[r]) < seq)]
    op = next(group.ops[r][seq] for r in inside)
    lines = []
    for r in behind:
        last = _last_done(group.ops[r])
        ago = ""
        when = last and (last.get("ended") or last.get("issued"))
        if when and dumps[r].get("time"):
            ago = f", {'finished' if last.get('ended') else 'issued'} {dumps[r]['time'] - when:.1f} s before its dump"
        was = f"its last op was {_call(last)}{ago}" if last else "it issued no op of this group"
        text = f"{group.label()}: rank {r} is behind: it never called op {_call(op)}; {was}"
        report.findings.append(Finding("behind", group.name, seq, [r], text))
        lines.append(f"  BEHIND: rank {r} never called op {_call(op)}; {was} "
                     f"(dumped on {_short(dumps[r].get('reason'), 60) or 'request'})")
    if inside:
        named = sorted({w for r in inside for w in group.ops[r][seq].get("waiting_on") or ()})
        lost = sorted({group.ops[r][seq]["lost_rank"] for r in inside
                       if group.ops[r][seq].get("lost_rank") is not None})
        waited = named or behind
        lines.append(f"  WAITING: {_ranks(inside)} in op {_call(op)}"
                     + (f", waiting for {_ranks(waited)}" if waited else "")
                     + (f"; {_ranks(lost)} {'was' if len(lost) == 1 else 'were'} lost" if lost else ""))
        for r in inside:
            e = group.ops[r][seq]
            since = ""
            if e.get("started") and dumps[r].get("time"):
                since = f" for {(e.get('ended') or dumps[r]['time']) - e['started']:.1f} s"
            what = f"failed{since}: {_short(e.get('error'))}" if e["state"] == "failed" else \
                f"{e['state']}{since} when it dumped ({_short(dumps[r].get('reason'), 60) or 'request'})"
            lines.append(f"    rank {r}: {what}")
        if not behind and not named and not lost:
            report.findings.append(Finding("failed", group.name, seq, inside,
                                           f"{group.label()}: {_ranks(inside)} did not finish op {_call(op)}"))
    return lines


def _absent(group: _Group, present: list[int], rank: int, stuck: int | None, report: Report) -> list[str]:
    finished = [e for r in present for e in group.ops[r].values() if e["state"] == "done"]
    last = max(finished, key=lambda e: e["seq"]) if finished else None
    lines = [f"  NO DUMP: rank {rank} left no flight recorder (killed, or stopped before it could write)"]
    seen = (f"its peers last completed op {_call(last)} with it" if last
            else "its peers completed no op of this group with it")
    lost, waiters = [], []
    for r in present:
        for e in group.ops[r].values():
            if e.get("lost_rank") == rank:
                lost.append((r, e))
            elif rank in (e.get("waiting_on") or ()):
                waiters.append((r, e))
    if stuck is not None:
        op = next((group.ops[r][stuck] for r in present if stuck in group.ops[r]), None)
        seen += f"; they were in op {_call(op)} without it" if op else ""
    lines.append(f"    {seen}")
    for r, e in [(r, e) for r, e in lost if e["seq"] != stuck][:3]:  # (the op stuck in is shown above)
        lines.append(f"    rank {r} (op #{e['seq']}): {_short(e.get('error'))}")
    for r, e in waiters[:3]:
        lines.append(f"    rank {r} waited for it in op {_call(e)}: {_short(e.get('error'))}")
    how = " and was lost (a peer saw it die)" if lost else ""
    report.findings.append(Finding("no_dump", group.name, stuck, [rank],
                                   f"{group.label()}: rank {rank} left no dump{how}; {seen}"))
    return lines


def _diagnosis(report: Report) -> str:
    if not report.findings:
        return "diagnosis: no problem found: every rank finished every op it issued."
    order = {"mismatch": 0, "behind": 1, "no_dump": 2, "failed": 3}
    first = sorted(report.findings, key=lambda f: order[f.kind])[0]
    advice = {
        "mismatch": "every rank of a group must call the same collectives in the same order with "
                    "the same dtype, count, root and op: look at the code path of the odd rank(s).",
        "behind": "look at what the rank behind was doing after its last op (its output, or "
                  "py-spy dump --pid of it while the job hangs).",
        "no_dump": "look at that rank's own output (a crash, an OOM kill, a signal) for why it died.",
        "failed": "read the error above; the other ranks' dumps show where they were.",
    }[first.kind]
    return f"diagnosis: {first.text}.\n  {advice}"


def summary(directory: str, since: float | None = None) -> str:
    """The report's text, for chorusrun to print when a job fails ("" when nothing to read)."""
    report = analyze(directory, since)
    return report.text if report.ranks else ""


def main(argv: list[str] | None = None) -> int:
    """``chorus analyze DIR``: print the diagnosis; exit 1 if it found a problem, 0 if not,
    2 when DIR holds no dump."""
    p = argparse.ArgumentParser(
        prog="chorus analyze",
        description="Read the flight recorder dumps (rank<N>.json) of every rank in DIR and say "
                    "which ranks are behind, at which op, who waits for them, mismatched calls and "
                    "ranks without a dump. Exit status: 1 problem found, 0 none, 2 no dumps.")
    p.add_argument("directory", help="CHORUS_FLIGHT_RECORDER_DIR of the job")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = p.parse_args(argv)
    report = analyze(args.directory)
    if args.json:
        print(json.dumps({"directory": report.directory, "ranks": report.ranks, "world": report.world,
                          "problem": report.problem,
                          "findings": [f.__dict__ for f in report.findings]}, indent=2))
    else:
        sys.stdout.write(report.text)
    if not report.ranks:
        return 2
    return 1 if report.problem else 0


if __name__ == "__main__":
    sys.exit(main())
