"""A group's CUDA workspace: allocated on each member's current device, mapped by every
other member, and checked by a real transfer before use (chorus.cuda.layout draws it).

``Workspace.create`` is collective (every member calls it when the group attaches).
Members publish, under ``cuda/<group id>/<generation>/`` in the job's store: their host,
process id, device, the workspace's address and its CUDA IPC handle.  Each then maps
every peer's workspace: ``cudaIpcOpenMemHandle`` for a peer in another process; the
address itself for a peer that is a thread of this process (chorus.testing runs ranks
as threads; a process cannot open its own handles), with peer access enabled between
the two devices.  Members agree through the store after mapping and after the check,
so either every member uses the workspace or none does (:class:`Unusable` says why).
"""

from __future__ import annotations

import os
import pickle
import socket

import numpy as np

from chorus.cuda import kernels, runtime
from chorus.cuda import layout as L

CHECK_TIMEOUT_S = 60.0  # the check's spins give up after this (or the group's timeout if shorter)


class Unusable(Exception):
    """Peer memory cannot be used by this group; the message says why (one line)."""


def _host_id() -> str:
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
        self.ptr = runtime.malloc(total)
        self.host_addr = runtime.host_alloc(L.CONTROL_WORDS * 8)
        self.words = runtime.host_words(self.host_addr, L.CONTROL_WORDS)
        self.words[:] = 0
        self.bases: list[int] = []
        self._opened: list[int] = []
        self._torch = torch
        torch.as_tensor(runtime.DeviceArray(self.ptr, total), device=self.device).zero_()
        torch.cuda.synchronize(self.device)

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
        try:
            ws = cls(pg, total)
            info = dict(host=_host_id(), pid=os.getpid(), device=ws.device.index, ptr=ws.ptr,
                        handle=runtime.ipc_handle(ws.ptr))
        except Exception as exc:  # noqa: BLE001 - told to every member, then raised
            info, why = {}, f"{type(exc).__name__}: {exc}"
        store.set(f"{prefix}/info/{rank}", pickle.dumps(dict(info, error=why)))
        infos = [pickle.loads(store.get(f"{prefix}/info/{r}", timeout)) for r in range(world)]
        failed = next((f"rank {r}: {i['error']}" for r, i in enumerate(infos) if i["error"]), "")
        if not failed and len({i["host"] for i in infos}) > 1:
            failed = "the members are on several hosts"
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
            why = ws._check(min(timeout, CHECK_TIMEOUT_S))
            failed = agree(store, f"{prefix}/checked", rank, world, why, timeout)
            if failed:
                raise Unusable(failed)
        except BaseException:
            if ws is not None:
                ws.close()
            raise
        return ws

    def _map(self, infos: list[dict]) -> None:
        me = infos[self.rank]
        for r, info in enumerate(infos):
            if r == self.rank:
                self.bases.append(self.ptr)
            elif info["pid"] == me["pid"]:  # a thread of this process: same address space
                if info["device"] != self.device.index:
                    runtime.enable_peer_access(info["device"])
                self.bases.append(info["ptr"])
            else:
                ptr = runtime.ipc_open(info["handle"])
                self._opened.append(ptr)
                self.bases.append(ptr)

    def _check(self, timeout_s: float) -> str:
        """Write a pattern into my slot and into every peer's CHECK word for me, barrier,
        read every peer's pattern by copy engine and by kernel, barrier; "" if all came
        back right, else why not."""
        torch = self._torch
        w, me, dev = self.world, self.rank, self.device
        value = np.add.outer((np.arange(w) + 1) * 1_000_003, np.arange(w)).astype(np.int64)  # [writer, j]
        stream = torch.cuda.current_stream(dev).cuda_stream
        slot0 = [b + self.layout.slot_at(0) for b in self.bases]
        mine = torch.as_tensor(value[me], device=dev)
        runtime.memcpy_async(slot0[me], mine.data_ptr(), w * 8, stream)
        for q in range(w):
            runtime.memcpy_async(self.bases[q] + L.CHECK + 8 * me, mine.data_ptr() + 8 * q, 8, stream)
        controls = torch.tensor(self.bases, dtype=torch.int64, device=dev)
        timeout_ns = int(timeout_s * 1e9)
        kernels.barrier(controls, me, w, self.host_addr, 0, timeout_ns)
        got = torch.empty((w, w), dtype=torch.int64, device=dev)
        for r in range(w):
            runtime.memcpy_async(got[r].data_ptr(), slot0[r], w * 8, stream)
        summed = torch.empty(w, dtype=torch.int64, device=dev)
        rows = torch.tensor(slot0, dtype=torch.int64, device=dev)
        kernels.reduce(rows, 0, summed.data_ptr(), w, w, "SUM", "int64")
        checks = torch.empty(w, dtype=torch.int64, device=dev)
        runtime.memcpy_async(checks.data_ptr(), self.bases[me] + L.CHECK, w * 8, stream)
        kernels.barrier(controls, me, w, self.host_addr, 0, timeout_ns)
        torch.cuda.current_stream(dev).synchronize()
        if self.words[L.STATUS]:
            return (f"the check's barrier gave up (status {int(self.words[L.STATUS])}, ranks missing: "
                    f"{_ranks(int(self.words[L.FAIL_PEERS]))})")
        if not np.array_equal(got.cpu().numpy(), value):
            return "copies from peers' workspaces returned wrong data"
        if not np.array_equal(summed.cpu().numpy(), value.sum(axis=0)):
            return "a kernel reading peers' workspaces returned wrong data"
        if not np.array_equal(checks.cpu().numpy(), value[:, me]):
            return "copies into peers' workspaces did not arrive"
        return ""

    def close(self) -> None:
        """Unmap the peers' workspaces and free this rank's (after this rank's queued work)."""
        torch = self._torch
        self.words[L.ABORT] = 1  # queued spins end now instead of at their timeout
        torch.cuda.synchronize(self.device)
        for ptr in self._opened:
            runtime.ipc_close(ptr)
        self._opened.clear()
        runtime.free(self.ptr)
        runtime.host_free(self.host_addr)
        self.ptr = self.host_addr = 0


def _ranks(bits: int) -> list[int]:
    return [r for r in range(bits.bit_length()) if bits >> r & 1]
