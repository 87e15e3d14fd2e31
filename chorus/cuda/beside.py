"""``Beside``: a stream next to the caller's, for the barrier that checks an NCCL
hand-off without delaying it.

A group's call handed to NCCL (chorus.cuda.nccl) is compared with the other ranks'
calls by one barrier of chorus's workspace carrying its fingerprint
(chorus.cuda.component).  Queued in front of NCCL's kernel, that barrier cost 16-25 us
of GPU time per call from 8 MiB on 4 GPUs (NCCL's kernel could not start until the
slowest rank's barrier ended).  Here it runs beside NCCL's kernel::

    caller's stream   ... previous op | NCCL's kernel            | next op ...
                                      \\                          /
    beside                              barrier (fingerprint) ---'

``follow(raw)`` makes this stream wait for the work queued on stream ``raw`` so far and
returns this stream's handle (the barrier goes there); ``mark(raw)`` then ``follow()``
does the same in two steps, so that NCCL's kernel is queued between them and its launch
does not wait for the barrier's (a Triton launch); ``join(work)`` makes this stream wait
for NCCL's op where the caller's stream does not (an async hand-off; only once the group's
next op on chorus's kernels comes, chorus.cuda.lanes.Lanes.unjoined); ``end()`` records
where the barrier ends and returns that event: the group's next op waits for it
(chorus.cuda.lanes.Lanes.follow), so that barriers stay in epoch order.  NCCL's kernel
does not wait for it; a barrier that finds another op breaks the group, and the
communicator is aborted (NcclPeers.watch), so NCCL's kernel stops waiting too.
"""

from __future__ import annotations

import threading

from chorus.cuda import runtime


class Beside:
    """The stream beside the caller's on device ``device`` (a torch.device), and two
    events: the caller's work before the hand-off (``queued``), the barrier's end
    (``ended``)."""

    def __init__(self, device):
        import torch

        self.stream = torch.cuda.Stream(device)  # (kept: the raw handle lives as long as it does)
        self.raw = self.stream.cuda_stream
        self.queued = runtime.event_create()
        # torch's event, for synchronize(): cuda-bindings' cudaEventSynchronize keeps the GIL
        # while it blocks, and the transport's threads must go on meanwhile
        self.ended = torch.cuda.Event()
        self.waiter = None  # the stream of event_after's events (made at the first)
        self._lock = threading.Lock()

    def mark(self, raw: int) -> None:
        """Remember what stream ``raw`` has queued so far (the next follow() waits for it)."""
        runtime.event_record(self.queued, raw)

    def follow(self, raw: int | None = None) -> int:
        """This stream's handle, its next work after what stream ``raw`` has queued so far
        (None: as of the last mark())."""
        if raw is not None:
            runtime.event_record(self.queued, raw)
        runtime.stream_wait_event(self.raw, self.queued)
        return self.raw

    def join(self, work, stream=None) -> None:
        """This stream's (or ``stream``'s) later work waits for torch Work ``work``.
        Through its future, whose wait() orders the current stream (this one, for the call)
        and records the tensors' use on it: Work.wait() would also let go of the tensors
        NCCL holds, as if the caller's stream, where the allocator reuses their memory,
        waited."""
        import torch

        with torch.cuda.stream(self.stream if stream is None else stream):
            work.get_future().wait()

    def joined(self, work) -> int:
        """join(``work``), then end(): the event after NCCL's op (Lanes.unjoined's)."""
        self.join(work)
        return self.end()

    def event_after(self, work):
        """A new torch event after NCCL's op ``work`` alone (a CudaWork's, made only if
        asked for), recorded on a stream of its own that waited for it: not this one,
        whose later barriers belong to later ops (a Work waits for its op only, as
        ProcessGroupNCCL's)."""
        import torch

        with self._lock:
            if self.waiter is None:
                self.waiter = torch.cuda.Stream(self.stream.device)
        self.join(work, self.waiter)
        event = torch.cuda.Event()
        event.record(self.waiter)
        return event

    def end(self) -> int:
        """The event after the work queued here so far (the barrier), as a raw cudaEvent_t."""
        self.ended.record(self.stream)
        return self.ended.cuda_event

    def synchronize(self) -> None:
        """The host waits for the barrier (a group's first hand-off: see CudaComponent)."""
        self.ended.synchronize()

    def close(self) -> None:
        runtime.event_destroy(self.queued)
