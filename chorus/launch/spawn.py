"""``spawn(fn, args, nprocs)``: run ``fn(i, *args)`` in ``nprocs`` processes.

The contract is ``torch.multiprocessing.spawn``'s::

    def worker(i, world):            # i = 0 .. nprocs-1
        dist.init_process_group("chorus", rank=i, world_size=world, ...)

    chorus.spawn(worker, args=(4,), nprocs=4)        # returns when all four are done

- ``join=True`` waits; the first child that raises or dies makes the parent stop the
  others (SIGTERM, then SIGKILL after a grace period: all stopped within 5 s) and
  raise :class:`ProcessRaisedException` (with the child's traceback) or
  :class:`ProcessExitedException` (exit code or signal name).  Of the children that
  raised, the one reported is the first to raise an error of its own (not PeerLostError,
  which says it failed because another did), whichever exited first.  Each child writes
  its error (time, traceback) into a file of its own, whole or not at all, so that even
  a child stopped meanwhile is read.
- ``join=False`` returns a :class:`SpawnContext` to ``join()`` later.

Each child sees ``CHORUS_TOKEN`` (the parent's, or a fresh random one shared by the
job) and a fresh ``CHORUS_JOB_ID`` in ``os.environ`` before ``fn`` runs.  On Linux,
when ``spawn`` is called from the main thread, the children are also SIGKILLed if the
parent dies (``PR_SET_PDEATHSIG``), so that nothing outlives a ``kill -9``.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
import traceback

from chorus import config
from chorus.errors import ChorusError, InvalidArgumentError, PeerLostError
from chorus.launch.supervisor import STOP_GRACE_S, die_with_parent, signal_name

#: A traceback longer than this is cut (its tail kept).
_MAX_TRACEBACK_CHARS = 30_000


class ProcessException(ChorusError):
    """A spawned process failed; ``error_index`` is its ``i`` and ``error_pid`` its pid."""

    def __init__(self, msg: str, error_index: int, error_pid: int):
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid
        self.pid = error_pid

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.error_pid)


class ProcessRaisedException(ProcessException):
    """``fn`` raised in a spawned process; the message holds the child's traceback."""


class ProcessExitedException(ProcessException):
    """A spawned process exited non-zero or was killed by a signal without raising."""

    def __init__(self, msg: str, error_index: int, error_pid: int, exit_code: int,
                 signal_name: str | None = None):
        super().__init__(msg, error_index, error_pid)
        self.exit_code = exit_code
        self.signal_name = signal_name

    def __reduce__(self):
        return type(self), (self.msg, self.error_index, self.error_pid, self.exit_code,
                            self.signal_name)


def _child_main(fn, i, args, error_file, env, parent_pid, tie_to_parent):
    """Entry point of a spawned process: set up, run ``fn(i, *args)``, report a raise."""
    if tie_to_parent:
        die_with_parent(parent_pid)
    os.environ.update(env)
    try:
        fn(i, *args)
    except KeyboardInterrupt:
        pass  # the parent is stopping the job; exit quietly
    except Exception as exc:
        text = traceback.format_exc()
        if len(text) > _MAX_TRACEBACK_CHARS:
            text = "... (traceback cut)\n" + text[-_MAX_TRACEBACK_CHARS:]
        # PeerLostError: this process fails because another did (which one: see join)
        record = {"time": time.time(), "consequence": isinstance(exc, PeerLostError), "traceback": text}
        with open(error_file + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(error_file + ".tmp", error_file)  # whole or absent, even if killed meanwhile
        sys.exit(1)


class SpawnContext:
    """The processes started by :func:`spawn`; ``join()`` them to wait and get errors."""

    def __init__(self, processes, error_files):
        self.processes = processes
        self.error_files = error_files
        self._pending = {p.sentinel: i for i, p in enumerate(processes)}

    def pids(self) -> list[int]:
        """Process ids, by index."""
        return [int(p.pid) for p in self.processes]

    def join(self, timeout: float | None = None, grace_period: float = STOP_GRACE_S) -> bool:
        """Wait up to ``timeout`` seconds for the processes.

        Returns True when all have exited successfully, False if some still run.  When
        one has failed, stops the others (SIGTERM, SIGKILL after ``grace_period``) and
        raises :class:`ProcessRaisedException` or :class:`ProcessExitedException`.
        """
        if not self._pending:
            return True
        ready = multiprocessing.connection.wait(list(self._pending), timeout=timeout)
        failed = None
        for sentinel in ready:
            index = self._pending.pop(sentinel)
            proc = self.processes[index]
            proc.join()
            if proc.exitcode != 0:
                failed = index
                break
        if failed is None:
            if not self._pending:
                self._forget_error_files()
            return not self._pending
        seen_at = time.time()
        self._stop_others(grace_period)
        self._pending.clear()
        try:
            raise self._error_for(failed, seen_at)
        finally:
            self._forget_error_files()

    def _stop_others(self, grace_period: float) -> None:
        alive = [p for p in self.processes if p.is_alive()]
        for p in alive:
            p.terminate()
        deadline = time.monotonic() + grace_period
        for p in alive:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in alive:
            if p.is_alive():
                p.kill()
                p.join()

    def _error_for(self, index: int, seen_at: float) -> ProcessException:
        """The error to raise: the exception of the process that raised first - not one
        that failed because another did (PeerLostError) - else the failure of ``index``,
        the first process seen to fail (at ``seen_at``)."""
        raised = {i: r for i, r in enumerate(map(_read_error, self.error_files)) if r is not None}
        causes = [i for i, r in raised.items() if not r["consequence"] and (index in raised or r["time"] <= seen_at)]
        if causes or index in raised:
            index = min(causes, key=lambda i: raised[i]["time"]) if causes else index
            msg = f"\n\n-- Process {index} terminated with the following error:\n{raised[index]['traceback']}"
            return ProcessRaisedException(msg, index, self.processes[index].pid)
        proc = self.processes[index]
        code = proc.exitcode
        if code < 0:
            name = signal_name(-code)
            return ProcessExitedException(f"process {index} terminated with signal {name}",
                                          index, proc.pid, code, name)
        return ProcessExitedException(f"process {index} terminated with exit code {code}",
                                      index, proc.pid, code)

    def _forget_error_files(self) -> None:
        if self.error_files:
            shutil.rmtree(os.path.dirname(self.error_files[0]), ignore_errors=True)


def _read_error(path: str) -> dict | None:
    """What a child wrote into its error file, or None (it did not raise)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def set_start_method(method: str, force: bool = False) -> None:
    """What ``torch.multiprocessing.set_start_method`` does, for scripts that use chorus in
    its place: sets this process's multiprocessing start method (``spawn``, ``fork`` or
    ``forkserver``).  As with torch, :func:`spawn` keeps its own ``start_method="spawn"``
    unless given another."""
    multiprocessing.set_start_method(method, force=force)


def get_start_method(allow_none: bool = False) -> str | None:
    """``multiprocessing.get_start_method``, as torch.multiprocessing re-exports it."""
    return multiprocessing.get_start_method(allow_none=allow_none)


def spawn(fn, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str = "spawn") -> SpawnContext | None:
    """Run ``fn(i, *args)`` for ``i`` in ``range(nprocs)``, each in its own process.

    ``fn`` must be picklable (a module-level function) for the ``spawn`` start method.
    Returns None when ``join`` is True (after every process finished), else the
    :class:`SpawnContext`::

        def worker(i, world):                       # process i of nprocs
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
            chorus.init_process_group("gloo", rank=i, world_size=world)
            ...

        chorus.spawn(worker, args=(4,), nprocs=4)   # worker(0, 4) .. worker(3, 4)

    If a process raises, the others are stopped and ``spawn`` raises
    :class:`ProcessRaisedException` with that process's traceback.
    """
    if nprocs < 1:
        raise InvalidArgumentError(f"spawn(nprocs={nprocs}): needs at least 1 process")
    ctx = multiprocessing.get_context(start_method)
    env = {
        "CHORUS_TOKEN": config.get("CHORUS_TOKEN") or secrets.token_hex(16),
        "CHORUS_JOB_ID": secrets.token_hex(8),
    }
    # Children die with the caller (PR_SET_PDEATHSIG), but a forkserver's children are the
    # fork server's, not the caller's: they cannot be tied to it (the check that the parent
    # is still alive would see the fork server and kill them).
    tie_to_parent = threading.current_thread() is threading.main_thread() and start_method != "forkserver"
    error_dir = tempfile.mkdtemp(prefix="chorus-spawn-")
    error_files = [os.path.join(error_dir, f"{i}.json") for i in range(nprocs)]
    processes = []
    try:
        for i in range(nprocs):
            p = ctx.Process(target=_child_main, daemon=daemon,
                            args=(fn, i, args, error_files[i], env, os.getpid(), tie_to_parent))
            p.start()
            processes.append(p)
    except BaseException:
        context = SpawnContext(processes, error_files)
        context._stop_others(grace_period=0.0)
        context._forget_error_files()
        raise
    context = SpawnContext(processes, error_files)
    if not join:
        return context
    while not context.join():
        pass
    return None
