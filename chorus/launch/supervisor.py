"""Start, watch and stop the rank processes of one node.

Theory of operation::

    launcher ──Popen──> rank 0  (own session/process group, PDEATHSIG=SIGKILL)
             ──Popen──> rank 1        stdout ─pipe─> reader thread ─> "[rank1]:line" on stdout
             ...                      stderr ─pipe─> reader thread ─> "[rank1]:line" on stderr
                                                                  └─> rank1.log (raw, optional)

The main thread waits for a rank to exit (on the ranks' pidfds where Linux has them,
else polling every ``POLL_INTERVAL_S``) and notes the order in which they end.  The first
rank that exits non-zero (or by a signal), or a signal received by the launcher, starts
the stop sequence: SIGTERM to every remaining rank's process group, then SIGKILL to
whatever is still alive after ``grace_s`` seconds.  "First" is the order of exits, not of
rank numbers: when rank 2 is killed and ranks 0 and 1 exit with PeerLostError a few
milliseconds later, rank 2 is reported.  Ranks first seen dead at the same look are
ordered killed-by-a-signal first (a crash is a cause; an error exit is often a reaction
to it), then by rank.

The order of exits starts the stop sequence; the report names the rank whose error came
first in time.  Each rank gets ``TORCHELASTIC_ERROR_FILE`` (as under torchrun), where a
chorus job's rank writes its own error when it fails (``chorus.api.crash``; a survivor's
PeerLostError is not written there) and torch's ``@record`` writes any error.  The rank
reported is the one whose file holds the earliest error - one written before the first
exit was seen, unless that rank wrote one itself - else the first rank seen to fail.
:meth:`Supervisor.run` returns an :class:`Outcome` that names it; :func:`format_failure`
turns it into the report printed to stderr.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO

#: Seconds between SIGTERM and SIGKILL when stopping ranks (everything is stopped
#: within 5 s of the first failure).
STOP_GRACE_S = 3.0
#: Seconds between two looks at the ranks' exit status.
POLL_INTERVAL_S = 0.05
#: Lines of a failed rank's stderr quoted in the failure report.
TAIL_LINES = 20


@dataclass
class RankSpec:
    """What to run for one local rank: its global rank, command and full environment."""

    rank: int
    local_rank: int
    cmd: list[str]
    env: dict[str, str]


@dataclass
class RankFailure:
    """How a rank ended badly: ``exit_code`` is the Popen return code (negative = signal)."""

    rank: int
    local_rank: int
    pid: int
    exit_code: int
    stderr_tail: list[str] = field(default_factory=list)
    error: str | None = None  # "ValueError: ...", from the rank's error file

    @property
    def signal_name(self) -> str | None:
        """Name of the signal that killed the rank (``"SIGKILL"``), or None."""
        return signal_name(-self.exit_code) if self.exit_code < 0 else None

    @property
    def launcher_exit_code(self) -> int:
        """Exit code the launcher reports: the rank's, or 128 + signal number."""
        return 128 - self.exit_code if self.exit_code < 0 else self.exit_code


@dataclass
class Outcome:
    """Result of :meth:`Supervisor.run`."""

    exit_code: int
    first_failure: RankFailure | None = None
    received_signal: int | None = None


def signal_name(signum: int) -> str:
    """``9 -> "SIGKILL"``; unknown numbers give ``"signal 42"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _load_prctl():
    """Return libc's ``prctl`` on Linux, else None (looked up once, before any fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only).

    Runs in the child (as a ``preexec_fn``, or first thing in a spawned process).  If
    the parent already died before the request was made, kill ourselves right away.
    """
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


class _Sink:
    """A line-at-a-time, thread-safe writer to a console stream (bytes).

    If the console goes away (``chorusrun ... | head``), output is dropped from then
    on, so that the readers keep draining the ranks' pipes and no rank blocks.
    """

    def __init__(self, stream: IO):
        self._binary = getattr(stream, "buffer", None)
        self._text = stream
        self._lock = threading.Lock()
        self._broken = False

    def write_line(self, data: bytes) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                if self._binary is not None:
                    self._text.flush()
                    self._binary.write(data)
                    self._binary.flush()
                else:
                    self._text.write(data.decode("utf-8", "replace"))
                    self._text.flush()
            except (OSError, ValueError):
                self._broken = True


class _RankProcess:
    """One running rank: its Popen, reader threads, log file and stderr tail."""

    def __init__(self, spec: RankSpec, popen: subprocess.Popen, log: IO | None):
        self.spec = spec
        self.popen = popen
        self.log = log
        self.log_lock = threading.Lock()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.threads: list[threading.Thread] = []

    def start_readers(self, out: _Sink, err: _Sink) -> None:
        for pipe, sink, keep_tail in ((self.popen.stdout, out, False), (self.popen.stderr, err, True)):
            t = threading.Thread(
                target=self._pump, args=(pipe, sink, keep_tail),
                name=f"chorusrun-rank{self.spec.rank}-reader", daemon=True,
            )
            t.start()
            self.threads.append(t)

    def _pump(self, pipe: IO[bytes], sink: _Sink, keep_tail: bool) -> None:
        prefix = f"[rank{self.spec.rank}]:".encode()
        try:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"  # partial last line, flushed at EOF
                sink.write_line(prefix + line)
                if self.log is not None:
                    with self.log_lock:
                        self.log.write(line)
                        self.log.flush()
                if keep_tail:
                    self.stderr_tail.append(line.decode("utf-8", "replace").rstrip("\n"))
        except (OSError, ValueError):
            pass  # pipe closed under us while stopping
        finally:
            pipe.close()

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the rank's whole process group (it leads its own session)."""
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def finish(self, timeout: float) -> None:
        """Wait for the reader threads to drain the pipes, then close the log."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.log is not None:
            with self.log_lock:
                self.log.close()


class Supervisor:
    """Run a set of ranks to completion, stopping them all on the first failure.

    ``log_dir``, when given, receives ``rank{N}.log`` per rank with its raw stdout and
    stderr (the console output is prefixed; the files are not).
    """

    def __init__(self, specs: list[RankSpec], log_dir: str | None = None,
                 grace_s: float = STOP_GRACE_S, stdout: IO | None = None,
                 stderr: IO | None = None):
        self.specs = specs
        self.log_dir = log_dir
        self.grace_s = grace_s
        self._out = _Sink(stdout or sys.stdout)
        self._err = _Sink(stderr or sys.stderr)
        self._ranks: list[_RankProcess] = []
        self._exits: list[_RankProcess] = []  # in the order they were seen to end
        self._signal: int | None = None
        self._error_dir: str | None = None  # the ranks' TORCHELASTIC_ERROR_FILEs
        self._first_seen_at = 0.0

    def request_stop(self, signum: int) -> None:
        """Called from a signal handler: forward ``signum`` and stop all ranks."""
        if self._signal is None:
            self._signal = signum

    def start(self) -> None:
        """Start every rank; if one cannot be started, stop those already running."""
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
        parent = os.getpid()
        self._error_dir = tempfile.mkdtemp(prefix="chorusrun-errors-")
        try:
            for spec in self.specs:
                log = None
                if self.log_dir:
                    log = open(os.path.join(self.log_dir, f"rank{spec.rank}.log"), "wb")
                env = dict(spec.env, TORCHELASTIC_ERROR_FILE=self._error_file(spec.rank))
                popen = subprocess.Popen(
                    spec.cmd, env=env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True, preexec_fn=lambda: die_with_parent(parent),
                )
                self._ranks.append(_RankProcess(spec, popen, log))
        except BaseException:
            self._stop_all(signal.SIGKILL)
            for r in self._ranks:
                r.popen.wait()
            shutil.rmtree(self._error_dir, ignore_errors=True)
            raise
        # Reader threads start only after every fork: forking next to running threads
        # with a preexec_fn is what the subprocess docs warn about.
        for r in self._ranks:
            r.start_readers(self._out, self._err)

    def pids(self) -> list[int]:
        """The process ids of the ranks started so far."""
        return [r.popen.pid for r in self._ranks]

    def run(self) -> Outcome:
        """Start the ranks (if not started) and supervise them until all have exited."""
        if not self._ranks:
            self.start()
        pidfds = _pidfds(self._ranks)
        try:
            return self._supervise(pidfds)
        finally:
            for fd in pidfds:
                os.close(fd)
            shutil.rmtree(self._error_dir, ignore_errors=True)

    def _supervise(self, pidfds: dict[int, _RankProcess]) -> Outcome:
        first: RankFailure | None = None
        stopping_since: float | None = None
        killed = False
        while True:
            running = self._note_exits()
            if first is None and stopping_since is None:
                first = self._first_failure()
                self._first_seen_at = time.time()
            if stopping_since is None and (first is not None or self._signal is not None):
                stopping_since = time.monotonic()
                self._stop_all(self._signal or signal.SIGTERM)
            if not running:
                break
            if stopping_since is not None and not killed and \
                    time.monotonic() - stopping_since >= self.grace_s:
                self._stop_all(signal.SIGKILL)
                killed = True
            _wait_for_an_exit([fd for fd, r in pidfds.items() if r in running], POLL_INTERVAL_S)
        if stopping_since is not None:
            self._stop_all(signal.SIGKILL)  # leftovers in the ranks' process groups
        for r in self._ranks:
            r.finish(timeout=2.0)
        if first is not None:
            first = self._first_cause(first)
            first.stderr_tail = list(self._rank_by_number(first.rank).stderr_tail)
            return Outcome(first.launcher_exit_code, first, self._signal)
        if self._signal is not None:
            return Outcome(128 + self._signal, None, self._signal)
        return Outcome(0)

    def _note_exits(self) -> list[_RankProcess]:
        """Record the ranks that ended since the last look (see the module docstring for the
        order); return those still running."""
        running, ended = [], []
        for r in self._ranks:
            if r.popen.poll() is None:
                running.append(r)
            elif r not in self._exits:
                ended.append(r)
        ended.sort(key=lambda r: (r.popen.returncode >= 0, r.spec.rank))
        self._exits.extend(ended)
        return running

    def _first_failure(self) -> RankFailure | None:
        for r in self._exits:
            code = r.popen.returncode
            if code != 0:
                return RankFailure(r.spec.rank, r.spec.local_rank, r.popen.pid, code)
        return None

    def _error_file(self, rank: int) -> str:
        return os.path.join(self._error_dir, f"rank{rank}.json")

    def _first_cause(self, first: RankFailure) -> RankFailure:
        """The failed rank whose error file holds the earliest error (see the module
        docstring), else ``first``."""
        errors = {}
        for r in self._ranks:
            if r.popen.returncode:
                error = read_error_file(self._error_file(r.spec.rank))
                if error is not None:
                    errors[r.spec.rank] = error
        if first.rank not in errors:
            errors = {rank: e for rank, e in errors.items() if e[0] <= self._first_seen_at}
        if not errors:
            return first
        rank = min(errors, key=lambda rank: (errors[rank][0], rank))
        r = self._rank_by_number(rank)
        return RankFailure(rank, r.spec.local_rank, r.popen.pid, r.popen.returncode, error=errors[rank][1])

    def _rank_by_number(self, rank: int) -> _RankProcess:
        return next(r for r in self._ranks if r.spec.rank == rank)

    def _stop_all(self, signum: int) -> None:
        for r in self._ranks:
            r.signal_group(signum)


def read_error_file(path: str) -> tuple[float, str] | None:
    """(time, message) of the error a rank wrote into its ``TORCHELASTIC_ERROR_FILE`` (torch's
    ``@record`` format, whose time is whole seconds; chorus adds it with a fraction), or None."""
    try:
        with open(path) as f:
            data = json.load(f)
        message = data["message"]
        if isinstance(message, str):
            when, text = data.get("timestamp", 0), message
        else:
            when, text = message["extraInfo"]["timestamp"], message["message"]
        return float(data.get("chorus", {}).get("time", when)), str(text)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _pidfds(ranks: list[_RankProcess]) -> dict[int, _RankProcess]:
    """A pidfd per rank (readable once it exits), or none where Linux < 5.3 or not Linux."""
    fds: dict[int, _RankProcess] = {}
    for r in ranks:
        try:
            fds[os.pidfd_open(r.popen.pid)] = r
        except (AttributeError, OSError):  # no pidfd_open (or already reaped): poll instead
            for fd in fds:
                os.close(fd)
            return {}
    return fds


def _wait_for_an_exit(pidfds: list[int], timeout: float) -> None:
    """Return when one of ``pidfds`` is readable (its rank exited), or after ``timeout``."""
    if pidfds:
        poller = select.poll()  # not select.select: pidfds may exceed FD_SETSIZE with many ranks
        for fd in pidfds:
            poller.register(fd, select.POLLIN)
        poller.poll(timeout * 1000)
    else:
        time.sleep(timeout)


def format_failure(failure: RankFailure, world_size: int) -> str:
    """The report printed to stderr when a rank fails (multi-line, ends with newline)."""
    how = (f"killed by signal {failure.signal_name}" if failure.signal_name
           else f"exited with code {failure.exit_code}")
    lines = [
        "=" * 72,
        f"chorusrun: rank {failure.rank} (local rank {failure.local_rank}, "
        f"pid {failure.pid}) failed first: {how}.",
        *([f"chorusrun: its error: {_cut(failure.error)}"] if failure.error else []),
        f"chorusrun: stopped the other ranks of this node (world size {world_size}).",
    ]
    if failure.stderr_tail:
        n = len(failure.stderr_tail)
        lines.append(f"---- last {n} line{'s' if n != 1 else ''} of rank "
                     f"{failure.rank}'s stderr ----")
        lines.extend(failure.stderr_tail)
    else:
        lines.append(f"(rank {failure.rank} wrote nothing to stderr)")
    lines.append("=" * 72)
    return "\n".join(lines) + "\n"


def _cut(text: str, limit: int = 300) -> str:
    """The first line of ``text``, at most ``limit`` characters."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."
