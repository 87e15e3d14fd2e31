"""When a rank's process fails: tell the peers the cause, so every launcher reports it.

A rank fails when an exception escapes the script (``sys.excepthook``) or the function a
spawn runs: ``chorus.spawn`` and ``torch.multiprocessing.spawn`` catch it, hand the
traceback to the parent and call ``sys.exit(1)``; multiprocessing then runs its exit
finalizers with that ``SystemExit`` in flight, the exception as its ``__context__``.
:func:`install` hooks both.  On the first failure of the process (:func:`failed`):

- the rank is marked failed: at exit it does not say BYE (its peers must not take the
  failure for a clean ``destroy_process_group``);
- when the error is the rank's own (anything but a PeerLostError), it is written to
  ``TORCHELASTIC_ERROR_FILE`` if a launcher named one (chorusrun and torchrun do; torch's
  ``@record`` format, plus the time with its fraction under ``"chorus"``), and every peer
  is told "rank 1 failed with ValueError: ..." (a FAILED frame), so that their
  PeerLostError names the cause instead of a lost connection;
- when the error is a PeerLostError, the notices this rank queued when it noticed the
  loss (PEER_LOST, naming the lost rank) leave first (at most NOTICE_FLUSH_S): the exit
  closes this rank's connections, and a peer that saw that EOF before the notice would
  name this rank, a survivor, as the one lost.  Then, when some peer failed by raising,
  the rank waits until that peer's process has exited (at most FIRST_CAUSE_WAIT_S), and
  EXIT_MARGIN_S more, before it exits itself: ``torch.multiprocessing.spawn`` reports the
  first child it sees exit (by index when it sees several at one look), and that must be
  the one that raised.

Only ``Exception`` is relayed: a KeyboardInterrupt is a stop, not a failure (the rank
still leaves without BYE).  A spawned function's ``sys.exit(N)``, N != 0, is relayed as
"exit code N".
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable

from chorus.api.state import current
from chorus.errors import PeerLostError

log = logging.getLogger("chorus")

#: Longest wait, at exit, for the notices of a loss this rank noticed to leave (seconds).
NOTICE_FLUSH_S = 2.0
#: Longest wait, at exit, for a peer that raised to exit first (seconds).
FIRST_CAUSE_WAIT_S = 5.0
#: Further wait once it has: its parent must see it gone before this rank (seconds).
EXIT_MARGIN_S = 0.5

_installed = False
_failed = False


def has_failed() -> bool:
    """Whether this process has failed (then it leaves without BYE)."""
    return _failed


def install(leave: Callable[[], None]) -> None:
    """Hook this process's exits (once): uncaught exceptions, the exit finalizers of a
    multiprocessing child, and ``leave()`` at a normal exit with a job still joined."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def on_uncaught(kind, exc, tb):
        previous(kind, exc, tb)  # the traceback first: people read it before the peers' errors
        failed(exc)

    sys.excepthook = on_uncaught
    atexit.register(_at_exit, leave)
    mp = sys.modules.get("multiprocessing")
    if mp is not None and mp.parent_process() is not None:
        from multiprocessing import util

        util.Finalize(None, _in_flight, exitpriority=100)


def _in_flight() -> None:
    """A multiprocessing child's exit finalizer: the exception on its way out, if any."""
    exc = sys.exc_info()[1]
    if isinstance(exc, SystemExit):
        if exc.code in (None, 0):
            return
        cause = exc.__context__
        failed(cause if isinstance(cause, Exception) else f"exit code {exc.code}")
    elif isinstance(exc, BaseException):
        failed(exc)


def _at_exit(leave: Callable[[], None]) -> None:
    if current().default_group is not None and not _failed:
        try:
            leave()
        except Exception as exc:  # noqa: BLE001 - nothing to do at exit but log
            log.debug("chorus: clean-up at exit failed: %s", exc)


def failed(error: BaseException | str) -> None:
    """This process is failing with ``error`` (an exception, or text such as "exit code 3");
    see the module docstring.  Only the first call does anything."""
    global _failed
    if _failed:
        return
    _failed = True
    if isinstance(error, BaseException) and not isinstance(error, Exception):
        return
    world = current()
    transport = world.transport
    try:
        if isinstance(error, PeerLostError):
            if transport is not None:
                transport.flush(NOTICE_FLUSH_S)
                _let_causes_exit_first(transport)
            return
        text = describe(error)
        _write_error_file(error, text, world.rank)
        if transport is not None:
            transport.report_failure(text)
    except Exception as exc:  # noqa: BLE001 - the process is failing already; do not mask why
        log.debug("chorus: reporting this rank's failure failed: %s", exc)


def describe(error: BaseException | str) -> str:
    """``"ValueError: bad input"``: the error's last line(s) as a traceback shows them."""
    if isinstance(error, str):
        return error
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def _let_causes_exit_first(transport) -> None:
    ranks = [r for r in list(transport.raised) if r != transport.rank]
    if not ranks:
        return
    deadline = time.monotonic() + FIRST_CAUSE_WAIT_S
    exited = [transport.wait_exited(r, max(0.0, deadline - time.monotonic())) for r in ranks]
    if any(exited):
        time.sleep(EXIT_MARGIN_S)


def _write_error_file(error: BaseException | str, text: str, rank: int) -> None:
    """Write the failure where the launcher looks (``TORCHELASTIC_ERROR_FILE``), unless
    something (torch's ``@record``) already did."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    now = time.time()
    stack = text
    if isinstance(error, BaseException):
        stack = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    data = {"message": {"message": text, "extraInfo": {"py_callstack": stack, "timestamp": str(int(now))}},
            "chorus": {"rank": rank, "time": now}}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
