"""``CudaWork``: what an ``async_op=True`` CUDA call returns, with ProcessGroupNCCL's
semantics.

The op was enqueued on the caller's current stream; a CUDA event recorded right after
it marks its end.

- ``wait()`` makes the *current* stream wait for the event and returns at once (the CPU
  does not block), after checking the group's status (an earlier spin that gave up, a
  lost peer): then it raises.  ``wait(timeout)`` blocks the CPU up to ``timeout``
  seconds for the op itself and raises TimeoutError if it has not finished.
- ``synchronize()`` blocks the CPU until the op finished on the GPU, then checks.
- ``is_completed()`` queries the event; ``result()`` is the output tensors;
  ``get_future()`` a chorus Future completed (on a helper thread) once the op has.

The Work keeps the op's tensors alive until it finished (ops run on the caller's stream,
so the caching allocator never hands their memory to later work on that stream anyway;
the reference covers other streams).
"""

from __future__ import annotations

import threading
import time

from chorus.cuda import runtime
from chorus.work import Work


class CudaWork(Work):
    """``event``: a torch event recorded after the op, or (``native`` given) a function
    that makes one, called the first time one is needed (two threads asking at once may
    make two: either serves); ``check()`` raises the group's error, if any; ``native``:
    torch's own Work of the op where NCCL ran it whole: ``wait()`` is its wait (the
    current stream waits for NCCL's op, and NCCL lets go of the tensors it holds, as on
    ProcessGroupNCCL; the group's error first, where NCCL's wait raised because chorus
    broke the group), and its ``get_future()`` is the CUDA-aware future of ``result``,
    finished at once, that torch callers expect.
    """

    on_stream = True

    def __init__(self, event, check, result: list | None, keep: tuple = (), native=None):
        super().__init__(result)
        self._event_or_maker = event
        self._check = check
        self._keep = keep
        self.native = native

    @property
    def _event(self):
        event = self._event_or_maker
        if self.native is not None and callable(event):
            event = self._event_or_maker = event()
        return event

    def wait(self, timeout=None) -> bool:
        if timeout is not None:
            return self._block(time.monotonic() + (timeout.total_seconds() if hasattr(timeout, "total_seconds")
                                                     else float(timeout)))
        if self.native is not None:
            try:
                self.native.wait()
            except BaseException:
                self._check()  # (chorus's error, naming the ops, where it knows one)
                raise
        else:
            import torch

            # (raw handles: torch.cuda.current_stream() costs several microseconds per call)
            torch_c = torch._C
            runtime.stream_wait_event(torch_c._cuda_getCurrentRawStream(torch_c._cuda_getDevice()),
                                      self._event.cuda_event)
        self._check()
        return True

    def check(self) -> None:
        """Raise the group's error, if it has one now (nothing waits)."""
        self._check()

    def synchronize(self) -> None:
        self._block(None)

    def is_completed(self) -> bool:
        if not self._finished and self._event.query():
            self._done()
        return self._finished

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        self.is_completed()
        return self._error

    def result(self) -> list:
        return self._result

    def _block(self, deadline: float | None) -> bool:
        if deadline is None:
            self._event.synchronize()  # bounded: every spin in the op has a deadline
        else:
            while not self._event.query():
                if time.monotonic() >= deadline:
                    raise TimeoutError("Work.wait(timeout=...): Timed out before the op finished on the "
                                       "GPU; the op is still running")
                time.sleep(50e-6)
        self._done()
        if self._error is not None:
            raise self._error
        return True

    def _done(self) -> None:
        try:
            self._check()
            if self.native is not None:
                self.native.wait()  # (finished: NCCL lets go of the tensors it holds)
        except BaseException as exc:  # noqa: BLE001 - kept for wait/exception/the future
            self._settle(exc)
        else:
            self._settle(None)
        self._keep = ()

    # -- chorus.work.Work hooks -----------------------------------------------------------------
    def _wait(self, deadline: float | None) -> None:
        self._block(deadline)

    def _poll(self) -> bool:
        return self._event.query()

    def _watch(self) -> None:
        def run() -> None:
            self._event.synchronize()
            self._done()

        threading.Thread(target=run, daemon=True, name="chorus-cuda-future").start()


class AllWorks(Work):
    """Several Works as one (an async staged p2p_batch): done when each is."""

    def __init__(self, works: list, result: list):
        super().__init__(result)
        self.works = works

    def _wait(self, deadline: float | None) -> None:
        for w in self.works:
            w.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _poll(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def _watch(self) -> None:
        left = [len(self.works)]

        def one(_) -> None:
            left[0] -= 1
            if left[0] == 0:
                self.is_completed()

        for w in self.works:
            w.get_future().add_done_callback(one)
