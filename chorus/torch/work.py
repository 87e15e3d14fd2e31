"""``TorchWork``: a ``torch.distributed.Work`` over one or more chorus ops.

torch (DDP's C++ reducer, functional collectives, ``async_op=True`` callers) gets this
object back from every backend method.  Its contract:

* ``wait(timeout)`` waits for every chorus op, runs the op's ``finish`` step once
  (copy-back of a flattened buffer, ...), and raises chorus's own error
  (``PeerLostError``, ``CollectiveMismatchError``, ``CommTimeoutError``) unchanged;
* ``get_future()`` returns a ``torch.futures.Future`` that completes by itself, in the
  thread that completes the last chorus op, with the op's output tensors (DDP's comm
  hooks read ``fut.value()[0]``) or with chorus's error; for ops queued on CUDA streams,
  a CUDA-aware future completed at once, as ProcessGroupNCCL's;
* torch keeps the Python object alive while it needs it (its C++ holder owns a
  reference), and this object keeps the chorus ops alive.

Waiting never holds the GIL: chorus's waits block in ``threading`` primitives and
sockets, so torch's autograd thread and chorus's worker threads run side by side.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from chorus.torch.errors import as_torch_error
from chorus.torch.profiling import Recording
from chorus.work import Work


def _seconds(timeout) -> float | None:
    """torch passes ``timedelta(0)`` (kNoTimeout) for "no limit"."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return s if s > 0 else None


class TorchWork(dist.Work):
    """A torch Work for chorus ops ``works`` (None entries ran synchronously)."""

    def __init__(self, works: list[Work | None], result: list, finish: Callable[[], None] | None = None,
                 source_rank: Callable[[], int] | None = None, recording: Recording | None = None):
        super().__init__()
        self._works = [w for w in works if w is not None]
        self._result = result
        self._finish = finish
        self._source_rank_fn = source_rank
        self._recording = recording  # the op's profiler event, ended when the op is done
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None
        self._base: torch.futures.Future | None = None
        self._resolved = False
        if not self._works:
            self._complete(None)

    # -- torch's Work API ---------------------------------------------------------------
    def wait(self, timeout=None) -> bool:
        if not self._done:
            limit = _seconds(timeout)
            try:
                for w in self._works:
                    w.wait(limit)
            except TimeoutError as exc:
                if limit is not None and not all(w.is_completed() for w in self._works):
                    raise  # the caller's own limit: the op goes on
                self._complete(exc)
            except BaseException as exc:  # noqa: BLE001 - kept, delivered below
                self._complete(exc)
            else:
                self._complete(None)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._done and all(w.is_completed() for w in self._works):
            self._settle_from_works()
        return self._done

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        self.is_completed()
        return self._error

    def result(self) -> list:
        self.wait()
        return self._result

    def synchronize(self) -> None:  # CPU ops have no stream to synchronize with
        return None

    def block_current_stream(self) -> None:
        return None

    def source_rank(self) -> int:
        if self._source_rank_fn is None:
            raise ValueError("source_rank() is only defined for receives from any source")
        self.wait()
        return self._source_rank_fn()

    _source_rank = source_rank

    def get_future(self) -> torch.futures.Future:
        """The op's future.  An error must reach C++ consumers (DDP's reducer) as an error,
        but ``Future.set_exception`` only marks the Python wrapper (the C++ future would
        complete *successfully* holding the exception object); so the future handed out
        is a ``then`` of an internal one, whose callback returns the outputs or raises
        the op's error — torch records a raising callback as a real error.

        Ops queued on CUDA streams get ProcessGroupNCCL's kind of future instead: a
        CUDA-aware one, completed at once, whose value's events follow the ops on the
        current stream (consumers' streams wait for those events, the CPU never does).
        DDP's reducer then queues its copies and the optimizer behind the all_reduces
        without waiting for the GPU.  An op NCCL ran whole hands out NCCL's own future."""
        with self._lock:
            if self._future is not None:
                return self._future
        devices = self._stream_devices()
        native = getattr(self._works[0], "native", None) if len(self._works) == 1 and devices else None
        if native is not None and self._finish is None:
            # NCCL ran the op whole (chorus.cuda.work.CudaWork): its own future is that kind
            # already, of the same tensors, and its events follow NCCL's op itself, so the
            # current stream goes on until the future's consumer waits (DDP's backward
            # computes the next buckets meanwhile, as with ProcessGroupNCCL)
            try:
                self._works[0].check()
            except BaseException as exc:  # noqa: BLE001 - delivered by the future below
                self._complete(exc)
            else:
                future = native.get_future()
                with self._lock:
                    self._future = future
                if self._recording is not None:  # (the op's CPU part is over; nothing calls wait())
                    self._recording.close()
                return future
        elif devices:
            try:
                self.wait()  # orders the current stream after the ops; a failed group raises
            except BaseException:  # noqa: BLE001 - delivered by the future below
                pass
            else:
                future = torch.futures.Future(devices=devices)
                future.set_result(self._result)
                with self._lock:
                    self._future = future
                return future
        with self._lock:
            if self._future is not None:
                return self._future
            self._base = torch.futures.Future()
            self._future = self._base.then(self._outcome)
            done = self._done
        if done:
            self._resolve()
        else:
            remaining = [len(self._works)]
            counter = threading.Lock()

            def one_done(_) -> None:
                with counter:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last:
                    self._settle_from_works()

            for w in self._works:
                w.get_future().add_done_callback(one_done)
        return self._future

    def _stream_devices(self) -> list:
        """The CUDA devices of the result's tensors when every op is queued on a stream
        (``Work.on_stream``; an op that ran synchronously is queued already), else []."""
        if not all(w.on_stream for w in self._works):
            return []
        return sorted({t.device for t in self._result if isinstance(t, torch.Tensor) and t.is_cuda},
                      key=lambda d: d.index)

    # -- completion -------------------------------------------------------------------------
    def _settle_from_works(self) -> None:
        error = next((w.exception() for w in self._works if w.exception() is not None), None)
        self._complete(error)

    def _complete(self, error: BaseException | None) -> None:
        """Run ``finish`` once (if every op succeeded), then resolve the future."""
        if self._recording is not None:
            self._recording.close()
        if error is not None:
            as_torch_error(error)
        with self._lock:
            if self._done:
                return
            if error is None and self._finish is not None:
                try:
                    self._finish()
                except BaseException as exc:  # noqa: BLE001 - the op's error
                    error = exc
            self._error = error
            self._done = True
            resolve = self._base is not None  # (a future handed out whole, NCCL's, is not ours to complete)
        if resolve:
            self._resolve()

    def _resolve(self) -> None:
        with self._lock:
            if self._resolved:
                return
            self._resolved = True
        self._base.set_result(None)  # runs _outcome, which completes self._future

    def _outcome(self, _base) -> list:
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self._done else "pending"
        return f"<chorus TorchWork {state}, {len(self._works)} op(s)>"
