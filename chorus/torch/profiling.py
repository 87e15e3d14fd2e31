"""chorus's ops in torch's profiler, recorded as torch's own backends record theirs.

While ``torch.profiler.profile`` or ``torch.autograd.profiler.profile`` records, every op
of a ``ChorusProcessGroup`` adds one event named ``"<backend>:<op>"`` (``chorus:all_reduce``,
``chorus:send``; the backend is the name torch created the group under), with the op's
input tensors (their shapes, with ``record_shapes=True``), from the call until the op has
finished.  gloo and nccl record theirs the same way, as *async* events: started in the
caller's thread, ended in another one.  So the end is always run by this module's own
thread, also for an op that finished inside the call, and the op's ``Work`` counts as done
only once its event has ended (a profiler that stops right after ``wait()`` sees it)::

    rank's thread:   enter("chorus:all_reduce", t) -> op runs -> work.wait() ----------> returns
    closing thread:                                            leave(event) -> done --^

torch's profiler records an event's end only under the profiler's thread-local state,
which a Python thread of chorus's lacks (an end run there leaves the event open until the
profile stops, as if the op had lasted that long).  So the end is registered, when the
event begins, as a callback of a torch future through torch's own hook for ends that come
later (``_call_end_callbacks_on_jit_fut``, which carries the caller's thread-local state
to wherever the future completes); the closing thread completes that future.

When no profiler records, ``profiling()`` is the only cost: one call into torch per op.
"""

from __future__ import annotations

import queue
import threading

import torch

_enter = torch.autograd._record_function_with_args_enter
#: (handle, future): ends the event once the future completes.  The overload for the
#: handle _enter returns, called as torch's record_function calls it (without the
#: function-override dispatch a torch Future, a Python subclass, would take): tens of
#: microseconds less per profiled op than the overload packet.
_end_when = torch.ops.profiler._call_end_callbacks_on_jit_fut._RecordFunction
_plain = torch._C.DisableTorchFunctionSubclass

#: ``profiling()``: whether torch's profiler is recording in this process (torch's own
#: function, called directly: it is asked once per op).
profiling = torch._C._autograd._profiler_enabled


class Recording:
    """One op's profiler event, opened at construction, closed by :func:`close`."""

    __slots__ = ("_done", "_closed", "_lock", "_sent")

    def __init__(self, name: str, tensors) -> None:
        handle = _enter(name, *tensors)
        self._done: torch.futures.Future = torch.futures.Future()
        with _plain():
            _end_when(handle, self._done)  # (here: the end takes this thread's profiler state along)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sent = False

    def close(self) -> None:
        """End the event on the closing thread and wait until it has (idempotent; any thread)."""
        with self._lock:
            send, self._sent = not self._sent, True
        if send:
            _closer.put(self)
        self._closed.wait()

    def _end(self) -> None:
        try:
            self._done.set_result(None)  # runs the end, on this thread
        finally:
            self._closed.set()


class _Closer:
    """The thread that ends the events: never an op's caller, so every event is async."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Recording] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, recording: Recording) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # also after a fork
                self._thread = threading.Thread(target=self._run, name="chorus-profiler-events", daemon=True)
                self._thread.start()
        self._queue.put(recording)

    def _run(self) -> None:
        while True:
            recording = self._queue.get()
            try:
                recording._end()
            except Exception:  # noqa: BLE001 - a profiler that stopped meanwhile: nothing to end
                pass


_closer = _Closer()
