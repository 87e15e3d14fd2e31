"""A group's CUDA workspace: allocated on each member's current device, mapped by every
other member, and checked by a real transfer before use (chorus.cuda.layout draws it).

``Workspace.create`` is collective (every member calls it when the group attaches).
Members publish, under ``cuda/<group id>/<generation>/`` in this init's store: their host,
process id, device, the workspace's address and its CUDA IPC handle.  Each then maps
every peer's workspace with ``cudaIpcOpenMemHandle``.  Members agree through the store
after mapping and after the check, so either every member uses the workspace or none
does (:class:`Unusable` says why; the group then stages through host memory).

Members that are threads of one process (chorus.testing runs ranks as threads) get no
workspace, and the group stages.  They would share their devices' CUDA contexts, where a
device memory allocation is a point of implicit synchronization (CUDA programming guide)
and, with peer access enabled between the devices, one thread's allocation (a kernel
module's first load, torch's allocator growing) can wait for a peer's kernel that spins
until this very thread arrives.  Four such threads on 4 H200s left a spinning barrier
kernel waiting 60 s for two of them (docs/results/4xh200/speed-run-8/gpu-tests/threads-failure.log),
and nothing can keep user code from allocating while a peer spins.  One process per GPU,
as torchrun and mp.spawn start them, is the layout chorus's kernels serve.

The members' hosts come from the boot id and host name, or from ``CHORUS_HOST_ID`` (as
chorus.host.identity reads it): members on several hosts never map each other.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import socket
import time

import numpy as np

from chorus import config
from chorus.api.safe_pickle import ObjectDecoder
from chorus.cuda import launchers as kernels
from chorus.cuda import layout as L
from chorus.cuda import peer_sum, runtime
from chorus.host.identity import host_id

log = logging.getLogger("chorus")

_PROCESS_TOKENS: dict[int, str] = {}


def process_token() -> str:
    """This process's name among the members: its pid and a random part, drawn again in
    a forked child (pids alone repeat across PID namespaces, one container's rank 1 and
    another's)."""
    pid = os.getpid()
    token = _PROCESS_TOKENS.get(pid)
    if token is None:
        token = _PROCESS_TOKENS[pid] = f"{pid}-{secrets.token_hex(8)}"
    return token


class Unusable(Exception):
    """Peer memory cannot be used by this group; the message says why (one line)."""


def _host_id(global_rank: int) -> str:
    if config.get("CHORUS_HOST_ID"):
        return f"CHORUS_HOST_ID={host_id(global_rank)}"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def agree(store, prefix: str, rank: int, world: int, why: str, timeout: float) -> str:
    """Publish this rank's verdict (``why``, "" = fine) and return the first failing
    member's reason ("" when every member is fine).  Collective."""
    store.set(f"{prefix}/{rank}", why.encode())
    for r in range(world):
        theirs = store.get(f"{prefix}/{r}", timeout).decode()
        if theirs:
            return f"rank {r}: {theirs}"
    return ""


class Phases:
    """Seconds between marks: ``end(name)`` closes the step begun at the last mark.

    >>> p = Phases(); p.end("allocate"); sorted(p.seconds)
    ['allocate']
    """

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._mark = time.perf_counter()

    def end(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._mark
        self._mark = now


class Workspace:
    """This rank's workspace and its view of every member's (see the module docstring).

    ``bases[r]``: the address (in this process) of group rank r's workspace;
    ``host_addr``/``words``: the control page (chorus.cuda.layout's words)."""

    def __init__(self, pg, total: int):
        import torch

        self.rank = pg.rank()
        self.world = pg.size()
        self.members = pg.members
        self.layout = L.Layout.of(self.world, total)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.bases: list[int] = []
        self.setup_s = 0.0  # seconds create() took: allocation, exchange, mapping and check
        self.phases: dict[str, float] = {}  # seconds of each of those steps (Phases), this rank's
        self._opened: list[int] = []
        self._torch = torch
        self.ptr = runtime.malloc(total)
        self.host_addr = 0
        try:
            self.host_addr = runtime.host_alloc(L.CONTROL_WORDS * 8)
            self.words = runtime.host_words(self.host_addr, L.CONTROL_WORDS)
            self.words.cast("B")[:] = bytes(8 * L.CONTROL_WORDS)
            torch.as_tensor(runtime.DeviceArray(self.ptr, total), device=self.device).zero_()
            torch.cuda.synchronize(self.device)
        except BaseException:  # (create() never got a workspace to close: let go of what was made here)
            runtime.free(self.ptr)
            if self.host_addr:
                runtime.host_free(self.host_addr)
            raise

    @staticmethod
    def itemsize(dtype: str) -> int:
        import torch
        return getattr(torch, dtype).itemsize

    @classmethod
    def create(cls, pg, store, prefix: str, total: int) -> Workspace:
        """Allocate, exchange, map and check (collective); raise Unusable on any member's
        failure, after every member has seen it."""
        rank, world, timeout = pg.rank(), pg.size(), pg.timeout
        ws, why = None, ""
        phases = Phases()
        kernels.warm_keys()  # (Triton's first-launch hashing, on a thread: the first launch waits for it)
        try:
            ws = cls(pg, total)
            info = dict(host=_host_id(pg.members[rank]), process=process_token(), device=ws.device.index, ptr=ws.ptr,
                        handle=runtime.ipc_handle(ws.ptr))
        except Exception as exc:  # noqa: BLE001 - told to every member, then raised
            info, why = {}, f"{type(exc).__name__}: {exc}"
        phases.end("allocate")
        store.set(f"{prefix}/info/{rank}", pickle.dumps(dict(info, error=why)))
        decode = ObjectDecoder("the CUDA workspace's set-up", pg.transport.authenticated)  # store values
        infos = [decode(store.get(f"{prefix}/info/{r}", timeout), pg.members[r]) for r in range(world)]
        phases.end("exchange")
        failed = next((f"rank {r}: {i['error']}" for r, i in enumerate(infos) if i["error"]), "")
        if not failed and len({i["host"] for i in infos}) > 1:
            failed = "the members are on several hosts"
        if not failed and len({i["process"] for i in infos}) < world:  # (known only now: each allocated)
            failed = ("some members are threads of one process (chorus.cuda.workspace says why; one process "
                      "per GPU, as torchrun or mp.spawn start them, runs chorus's kernels)")
        try:
            if failed:
                raise Unusable(failed)
            try:
                ws._map(infos)
            except Exception as exc:  # noqa: BLE001 - agreed below
                why = f"mapping peers' memory failed: {type(exc).__name__}: {exc}"
            failed = agree(store, f"{prefix}/mapped", rank, world, why, timeout)
            if failed:
                raise Unusable(failed)
            phases.end("map")
            why = ws._check(store, prefix, timeout)
            failed = agree(store, f"{prefix}/checked", rank, world, why, timeout)
            if failed:
                raise Unusable(failed)
            phases.end("check")
        except BaseException:
            if ws is not None:
                ws.close()
            raise
        ws.phases = phases.seconds
        return ws

    def _map(self, infos: list[dict]) -> None:
        with self._torch.cuda.device(self.device):
            for r, info in enumerate(infos):
                if r == self.rank:
                    self.bases.append(self.ptr)
                else:
                    ptr = runtime.ipc_open(info["handle"])
                    self._opened.append(ptr)
                    self.bases.append(ptr)

    def _check(self, store, prefix: str, timeout: float) -> str:
        """Write a pattern into my slot and into every peer's CHECK word for me; once every
        member has written (agreed through the store: Unusable, on every member, if one
        could not), read every peer's pattern by copy engine and by a kernel's loads
        (chorus.cuda.peer_sum) and my CHECK words; "" if all came back right, else why not.
        On the current stream.  No Triton kernel runs, so nothing is compiled here: the
        user's first op compiles what it needs."""
        torch = self._torch
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            try:
                why = self._write_pattern(stream)
            except Exception as exc:  # noqa: BLE001 - agreed below
                _drain(stream)
                why = f"writing into peers' workspaces failed: {type(exc).__name__}: {exc}"
            failed = agree(store, f"{prefix}/written", self.rank, self.world, why, timeout)
            if failed:
                raise Unusable(failed)
            try:
                return self._read_pattern(stream)
            except Exception as exc:  # noqa: BLE001 - agreed by the caller
                _drain(stream)
                return f"reading peers' workspaces failed: {type(exc).__name__}: {exc}"

    def _pattern(self):
        w = self.world
        return np.add.outer((np.arange(w) + 1) * 1_000_003, np.arange(w)).astype(np.int64)  # [writer, j]

    def _write_pattern(self, stream) -> str:
        torch = self._torch
        w, me = self.world, self.rank
        raw = stream.cuda_stream
        mine = torch.as_tensor(self._pattern()[me], device=self.device)
        runtime.memcpy_async(self.bases[me] + self.layout.slot_at(0), mine.data_ptr(), w * 8, raw)
        for q in range(w):
            runtime.memcpy_async(self.bases[q] + L.CHECK + 8 * me, mine.data_ptr() + 8 * q, 8, raw)
        stream.synchronize()  # (before ``mine`` goes)
        return ""

    def _read_pattern(self, stream) -> str:
        torch = self._torch
        w, me, dev = self.world, self.rank, self.device
        value = self._pattern()
        raw = stream.cuda_stream
        slot0 = [b + self.layout.slot_at(0) for b in self.bases]
        rows = torch.tensor(slot0, dtype=torch.int64, device=dev)
        got = torch.empty((w, w), dtype=torch.int64, device=dev)
        summed = torch.empty(w, dtype=torch.int64, device=dev)
        checks = torch.empty(w, dtype=torch.int64, device=dev)
        for r in range(w):
            runtime.memcpy_async(got[r].data_ptr(), slot0[r], w * 8, raw)
        try:
            peer_sum.sum_rows(rows.data_ptr(), summed.data_ptr(), w, raw)
        except peer_sum.PeerSumUnavailable as exc:  # (Triton's kernel reads the same way, compiled)
            log.info("chorus.cuda: the workspace check's PTX kernel does not load here (%s); reading "
                     "with a Triton kernel instead", exc)
            kernels.reduce(rows, 0, summed.data_ptr(), w, w, "SUM", "int64")
        runtime.memcpy_async(checks.data_ptr(), self.bases[me] + L.CHECK, w * 8, raw)
        stream.synchronize()
        if not np.array_equal(got.cpu().numpy(), value):
            return "copies from peers' workspaces returned wrong data"
        if not np.array_equal(summed.cpu().numpy(), value.sum(axis=0)):
            return "a kernel reading peers' workspaces returned wrong data"
        if not np.array_equal(checks.cpu().numpy(), value[:, me]):
            return "copies into peers' workspaces did not arrive"
        return ""

    def close(self) -> None:
        """Unmap the peers' workspaces and free this rank's (after this rank's queued work).
        Best effort: a failure is logged, never raised (a dead peer's handle may refuse)."""
        torch = self._torch
        self.words[L.ABORT] = 1  # queued spins end now instead of at their timeout
        steps = [lambda: torch.cuda.synchronize(self.device)]
        steps += [lambda p=ptr: runtime.ipc_close(p) for ptr in self._opened]
        steps.append(lambda: runtime.free(self.ptr))
        steps.append(lambda: runtime.host_free(self.host_addr))
        for step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the group is going away regardless
                log.warning("chorus: releasing a CUDA workspace: %s: %s", type(exc).__name__, exc)
        self._opened.clear()
        self.ptr = self.host_addr = 0


def _drain(stream) -> None:
    """Wait for what this rank queued on ``stream`` before a failed step's verdict goes
    out: the members then free their workspaces, which queued copies may still touch."""
    try:
        stream.synchronize()
    except Exception as exc:  # noqa: BLE001 - the verdict names the first failure
        log.warning("chorus: waiting for the CUDA workspace check's copies: %s: %s", type(exc).__name__, exc)
