"""A lane's repeated all_reduce replayed as a one-kernel CUDA graph.

An eager call of chorus's fused all_reduce costs a ``cuLaunchKernel``: 5.2-6.6 us of CPU
on a 4 x H200 host, where ``cuGraphLaunch`` of a graph holding the same kernel costs 2.0
(docs/results/4xh200/replay/probe-rank0.txt).  A graph freezes its kernel's arguments,
and an eager call's epoch and op id change every call, so the replayed kernel is the
fused kernel's third mode (``GRAPH`` = 2, chorus.cuda.fused.graph_begin): the eager
words, slots and protocol, but the epoch read from this rank's EPOCH word on the device
(the barriers so far, which every eager kernel keeps) and the op id reported on failure
``layout.REPLAY_OP + epoch`` (OpNames.replayed maps it back to the call).  What stays
frozen is the buffers' addresses and the slot's parity, so a Shot keeps a graph per
(input, output, parity):

    replays = Replays(shot, driver)          # one per Shot (a plan of the lane)
    used = replays(inp, out, parity, slot_off, stream)   # barriers used, or 0: nothing launched

A lane's all_gather_into_tensor and reduce_scatter_tensor replay the same way (their
kernels' ``GRAPH`` = 2 mode: chorus.cuda.gather); an all_reduce's input is its output.
The first call of an (input, output, parity) launches the replay kernel as a kernel (compiling
it once); the second captures it into a graph (relaxed stream capture on a stream of the
group's own) and launches the graph; later ones launch the graph.  A call with nothing
launched (no driver, a capture refused) leaves the caller its kernel launch; so does a
Replays turned off by an error, once and for good.
"""

from __future__ import annotations

import ctypes
import functools
import logging

from chorus.cuda import direct, launchers

log = logging.getLogger("chorus")

#: (input, output, parity) triples kept per Shot; a new one beyond them evicts the oldest (and
#: destroys its graph: each holds one kernel node)
KEPT = 64
_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING


class GraphDriver:
    """The libcuda entry points of stream capture and graph launch, typed."""

    def __init__(self, lib):
        vp, pvp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        self.begin = _typed(lib, "cuStreamBeginCapture_v2", vp, ctypes.c_int)
        self.end = _typed(lib, "cuStreamEndCapture", vp, pvp)
        self.instantiate = _typed(lib, "cuGraphInstantiateWithFlags", pvp, vp, ctypes.c_ulonglong)
        self.destroy_graph = _typed(lib, "cuGraphDestroy", vp)
        self.destroy = _typed(lib, "cuGraphExecDestroy", vp)
        self.create_stream = _typed(lib, "cuStreamCreate", pvp, ctypes.c_uint)
        self.destroy_stream = _typed(lib, "cuStreamDestroy_v2", vp)
        # untyped, for ready-made ctypes arguments: no conversion per call (as
        # chorus.cuda.direct.Driver's launch_ready)
        self.launch = lib["cuGraphLaunch"]
        self.launch.restype = ctypes.c_int

    def capture(self, stream: int, enqueue) -> ctypes.c_void_p:
        """The executable graph (a CUgraphExec) of what ``enqueue()`` queues on ``stream``
        (a stream of chorus's own, idle), captured in relaxed mode; raises RuntimeError
        where the driver refuses (the stream then left out of capture)."""
        _check(self.begin(stream, _RELAXED), "cuStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            enqueue()
        except BaseException:
            if not self.end(stream, ctypes.byref(graph)) and graph.value:
                self.destroy_graph(graph)  # (the launch raised: what was captured goes too)
            raise
        _check(self.end(stream, ctypes.byref(graph)), "cuStreamEndCapture")
        exe = ctypes.c_void_p()
        try:
            _check(self.instantiate(ctypes.byref(exe), graph, 0), "cuGraphInstantiateWithFlags")
        finally:
            self.destroy_graph(graph)
        return exe

    def new_stream(self) -> int:
        s = ctypes.c_void_p()
        _check(self.create_stream(ctypes.byref(s), _NON_BLOCKING), "cuStreamCreate")
        return s.value


def _typed(lib, name: str, *argtypes):
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_int, list(argtypes)
    return fn


def _check(err: int, what: str) -> None:
    if err:
        raise RuntimeError(f"{what} failed: CUresult {err}")


@functools.cache
def driver() -> GraphDriver | None:
    """The process's GraphDriver, or None (no libcuda, or one without these entry points)."""
    lib = direct.libcuda()
    try:
        return None if lib is None else GraphDriver(lib)
    except AttributeError:
        return None


class Replays:
    """The replay graphs of one Shot (a lane plan's fused launch), by (input address,
    output address, slot parity).  Calls must not overlap (the lane's lock).  ``kept``
    and ``graphs`` are read by the lanes' steady state too (Lanes.replay_kept launches a
    kept graph itself, calling ``refused()`` where the driver refuses it)."""

    def __init__(self, shot, graphs: GraphDriver, capture_stream: int):
        self.shot, self.graphs, self.capture_stream = shot, graphs, capture_stream
        self.kept: dict[tuple[int, int, int], object] = {}  # (inp, out, parity) -> CUgraphExec (0: seen once)
        self.on = True

    def __call__(self, inp: int, out: int, parity: int, slot_off: int, stream: int) -> int:
        exe = self.kept.get((inp, out, parity))
        if exe:  # (a repeat with other work to follow first: Lanes.replay_kept launches the rest)
            if self.graphs.launch(exe, ctypes.c_void_p(stream)) == 0:
                return self.shot.barriers
            return self._off("cuGraphLaunch refused a kept graph")
        if not self.on or (inp | out) & 15:
            return 0
        try:
            if exe is None:  # first sight: the replay kernel, launched (and compiled once)
                if len(self.kept) >= KEPT:
                    self._evict()
                self.kept[(inp, out, parity)] = 0
                return launchers.replay(self.shot, inp, out, slot_off, stream)
            block = launchers.replay_block(self.shot, inp, out, slot_off)
            if block is None:  # (its launch no longer cached: first sight again)
                del self.kept[(inp, out, parity)]
                return 0
            grid = self.shot.grid
            exe = self.graphs.capture(self.capture_stream, lambda: block(grid, self.capture_stream))
        except Exception as exc:  # noqa: BLE001 - nothing launched: the kernel launch, from now on
            return self._off(f"{type(exc).__name__}: {exc}")
        self.kept[(inp, out, parity)] = exe
        return self(inp, out, parity, slot_off, stream)

    def refused(self) -> None:
        """A kept graph's launch failed (the caller's own cuGraphLaunch of ``kept``): replays
        off from then on, as when ``__call__``'s launch fails."""
        self._off("cuGraphLaunch refused a kept graph")

    def _off(self, why: str) -> int:
        log.warning("chorus.cuda: replaying the lane's %s as a CUDA graph failed (%s); launching its kernel "
                    "instead", self.shot.kind if self.shot.kind in ("all_gather", "reduce_scatter") else "all_reduce",
                    why)
        self.on = False
        self.close()
        return 0

    def _evict(self) -> None:
        exe = self.kept.pop(next(iter(self.kept)))  # (the oldest: dicts keep their order)
        if exe:
            self.graphs.destroy(exe)

    def close(self) -> None:
        """Destroy the kept graphs (a launch in flight completes first: the driver's rule)."""
        for exe in self.kept.values():
            if exe:
                self.graphs.destroy(exe)
        self.kept.clear()
