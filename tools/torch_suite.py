"""Run torch's own distributed test suite against gloo or chorus and record every test's outcome.

The suite is ``torch.testing._internal.distributed.distributed_test`` (``DistributedTest``),
driven as torch's ``test/distributed/test_distributed_spawn.py`` drives it: every test in
``WORLD_SIZE`` freshly spawned ranks on CPU, rendezvous through a file.  The backend:

    gloo              torch's gloo
    chorus-for-gloo   every group torch would give gloo is a chorus group (the suite still
                      selects its gloo tests); see tools/torch_suite_ranks.py
    chorus            the suite told BACKEND=chorus: shows what torch keeps from a backend it
                      does not know

Usage::

    python3 tools/torch_suite.py --backend gloo --json gloo.json --log gloo.log
    python3 tools/torch_suite.py --backend chorus-for-gloo --json chorus.json --log chorus.log
    python3 tools/torch_suite.py --compare gloo.json chorus.json        # the differences
    python3 tools/torch_suite.py --backend chorus-for-gloo -k test_all_reduce_sum   # a few tests
    python3 tools/torch_suite.py --start spawn --passed-in gloo.json   # gloo's passes, ranks spawned

Each test prints one line as it finishes; ``--json`` keeps every test's outcome, time and
reason; ``--log`` takes the ranks' own output (tracebacks included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import unittest

OUTCOMES = ("passed", "failed", "skipped")


class Recorder(unittest.TestResult):
    """Each test's outcome, seconds and (for failures and skips) a one-line reason."""

    def __init__(self, report, total: int):
        super().__init__()
        self.report = report
        self.total = total
        self.outcomes: dict[str, dict] = {}
        self._started = 0.0

    def startTest(self, test):  # noqa: N802 - unittest's name
        super().startTest(test)
        self._started = time.monotonic()

    def _record(self, test, outcome: str, reason: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        seconds = round(time.monotonic() - self._started, 2)
        self.outcomes[name] = {"outcome": outcome, "seconds": seconds, "reason": reason}
        line = f"[{len(self.outcomes)}/{self.total}] {name}: {outcome} ({seconds:.1f} s)"
        print(line + (f" -- {reason}" if reason and outcome != "passed" else ""), file=self.report, flush=True)

    def addSuccess(self, test):  # noqa: N802
        super().addSuccess(test)
        self._record(test, "passed")

    def addSkip(self, test, reason):  # noqa: N802
        super().addSkip(test, reason)
        self._record(test, "skipped", str(reason))

    def addFailure(self, test, err):  # noqa: N802
        super().addFailure(test, err)
        self._record(test, "failed", _cause(self.failures[-1][1]))

    def addError(self, test, err):  # noqa: N802
        super().addError(test, err)
        self._record(test, "failed", _cause(self.errors[-1][1]))

    def addExpectedFailure(self, test, err):  # noqa: N802
        super().addExpectedFailure(test, err)
        self._record(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):  # noqa: N802
        super().addUnexpectedSuccess(test)
        self._record(test, "failed", "unexpected success")


def _cause(traceback_text: str) -> str:
    """The most telling line of a failed test's text: the ranks' own exception if the
    harness passed it on, else the last exception line."""
    lines = [ln.strip() for ln in traceback_text.splitlines() if ln.strip()]
    candidates = [ln for ln in lines if ("Error" in ln.split(":", 1)[0] or "Exception" in ln.split(":", 1)[0])
                  and ":" in ln and not ln.startswith(("File ", "raise ", "Traceback"))]
    inner = [ln for ln in candidates if not ln.startswith("RuntimeError: Process ")]
    line = (inner or candidates or lines or ["(no message)"])[-1]
    return line[:300]


def _select(case, patterns: list[str], exact: list[str]) -> list[str]:
    names = unittest.TestLoader().getTestCaseNames(case)
    unknown = sorted(set(exact) - set(names))
    if unknown:
        raise SystemExit(f"torch_suite: no test named {', '.join(unknown)} in torch's suite")
    if patterns or exact:
        names = [n for n in names if n in exact or any(p in n for p in patterns)]
    return names


def run(mode: str, world_size: int, start: str, patterns: list[str], exact: list[str], timeout: int, json_path: str | None,
        log_path: str | None) -> dict:
    os.environ["CHORUS_TORCH_SUITE_BACKEND"] = mode
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["CHORUS_TORCH_SUITE_START"] = start
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(timeout)
    report = sys.stdout
    if log_path:  # the ranks inherit descriptors 1 and 2: their output goes to the log
        report = os.fdopen(os.dup(1), "w")
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    import torch_suite_ranks

    case = torch_suite_ranks.TestDistBackendWithSpawn
    names = _select(case, patterns, exact)
    suite = unittest.TestSuite(case(n) for n in names)
    recorder = Recorder(report, len(names))
    started = time.monotonic()
    suite.run(recorder)
    wall = time.monotonic() - started
    counts = {o: sum(1 for r in recorder.outcomes.values() if r["outcome"] == o) for o in OUTCOMES}
    result = {
        "command": "python3 tools/torch_suite.py " + " ".join(sys.argv[1:]),
        "backend": mode, "world_size": world_size, "start": start, "torch": torch.__version__,
        "python": platform.python_version(), "wall_s": round(wall, 1), "counts": counts,
        "tests": recorder.outcomes,
    }
    print(f"{mode}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
          f"of {len(names)} in {wall:.0f} s", file=report, flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1, sort_keys=False)
            f.write("\n")
        print(f"wrote {json_path}", file=report, flush=True)
    return result


def compare(path_a: str, path_b: str) -> str:
    """The tests whose outcome differs between two result files, and the counts of each."""
    with open(path_a) as f:
        a = json.load(f)
    with open(path_b) as f:
        b = json.load(f)
    lines = [f"{'':24}{a['backend']:>18}{b['backend']:>18}"]
    for outcome in OUTCOMES:
        lines.append(f"{outcome:24}{a['counts'][outcome]:>18}{b['counts'][outcome]:>18}")
    lines.append(f"{'wall time (s)':24}{a['wall_s']:>18}{b['wall_s']:>18}")
    differ = sorted(n for n in set(a["tests"]) | set(b["tests"])
                    if a["tests"].get(n, {}).get("outcome") != b["tests"].get(n, {}).get("outcome"))
    lines.append(f"\n{len(differ)} test(s) with different outcomes:")
    for name in differ:
        ra, rb = a["tests"].get(name, {}), b["tests"].get(name, {})
        lines.append(f"  {name}: {ra.get('outcome', 'absent')} -> {rb.get('outcome', 'absent')}")
        for r in (ra, rb):
            if r.get("reason") and r.get("outcome") != "passed":
                lines.append(f"      {r['outcome']}: {r['reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", choices=("gloo", "chorus-for-gloo", "chorus"), default="chorus-for-gloo",
                        help="what the suite's process groups run on")
    parser.add_argument("--world-size", type=int, default=2, help="ranks per test")
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="run only tests whose name contains this (repeatable)")
    parser.add_argument("--test", dest="exact", action="append", default=[],
                        help="run this test (its full name; repeatable)")
    parser.add_argument("--passed-in", metavar="RESULT.json",
                        help="run only the tests that passed in this result file (e.g. gloo's)")
    parser.add_argument("--start", choices=("fork", "spawn"), default="fork",
                        help="how each test's ranks start (torch's own file spawns them)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds a test may take before torch's harness fails it")
    parser.add_argument("--json", help="write every test's outcome here")
    parser.add_argument("--log", help="send the ranks' output here instead of the terminal")
    parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                        help="print the tests whose outcome differs between two result files, and exit")
    args = parser.parse_args(argv)
    if args.compare:
        print(compare(*args.compare))
        return 0
    if args.passed_in:
        with open(args.passed_in) as f:
            args.exact += [n for n, r in json.load(f)["tests"].items() if r["outcome"] == "passed"]
    result = run(args.backend, args.world_size, args.start, args.patterns, args.exact, args.timeout, args.json,
                 args.log)
    return 1 if result["counts"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
