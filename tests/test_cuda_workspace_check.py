"""The CUDA workspace's check (chorus.cuda.workspace.Workspace._check) with host memory
standing in for the members' mapped workspaces: ranks as threads, copies by memmove and
the PTX kernel by its Python twin.  The kernel itself runs on GPUs
(tests/gpu/test_cuda_peer_sum.py)."""

from __future__ import annotations

import contextlib
import ctypes
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from chorus.api.state import current  # noqa: E402
from chorus.cuda import layout as L  # noqa: E402
from chorus.cuda import workspace  # noqa: E402
from chorus.store import HashStore  # noqa: E402
from chorus.testing import run_threads  # noqa: E402

W = 3
TOTAL = 1 << 20


class _Stream:
    cuda_stream = 0
    synced: list = []  # one entry per synchronize, over every rank's stream (append: no lost counts)

    def synchronize(self):
        self.synced.append(1)


_CUDA = types.SimpleNamespace(device=lambda d: contextlib.nullcontext(), current_stream=lambda d: _Stream())
_TORCH = types.SimpleNamespace(as_tensor=lambda x, device: torch.as_tensor(x), tensor=torch.tensor,
                               empty=torch.empty, int64=torch.int64, cuda=_CUDA)


def _sum_rows(rows, out, width, stream):
    """What chorus.cuda.peer_sum.sum_rows enqueues, at once: out[j] = sum_r rows[r][j]."""
    addrs = [ctypes.c_int64.from_address(rows + 8 * r).value for r in range(width)]
    for j in range(width):
        ctypes.c_int64.from_address(out + 8 * j).value = sum(
            ctypes.c_int64.from_address(a + 8 * j).value for a in addrs)


def _workspaces(memories):
    made = []
    for r in range(W):
        ws = object.__new__(workspace.Workspace)
        ws.rank, ws.world, ws.layout, ws.device = r, W, L.Layout.of(W, TOTAL), torch.device("cpu")
        ws.bases, ws._torch = [m.ctypes.data for m in memories], _TORCH
        made.append(ws)
    return made


def _run(monkeypatch, memcpy=None, sum_rows=_sum_rows):
    def memmove(dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)

    monkeypatch.setattr(workspace.runtime, "memcpy_async", memcpy or memmove)
    monkeypatch.setattr(workspace.peer_sum, "sum_rows", sum_rows)
    memories = [np.zeros(TOTAL // 8, np.int64) for _ in range(W)]
    spaces, store = _workspaces(memories), HashStore()

    def check(rank, world):
        try:
            return spaces[rank]._check(store, "cuda/0/0", 10.0)
        except workspace.Unusable as exc:
            return f"Unusable: {exc}"

    return run_threads(check, W), memories


def test_every_member_reads_every_peers_pattern_by_copy_and_by_kernel(monkeypatch):
    """Each member writes its pattern into its slot and its CHECK word into every peer's
    workspace; once all have written, each reads them all back: every verdict is fine
    and every CHECK word holds its writer's value."""
    verdicts, memories = _run(monkeypatch)
    assert verdicts == [""] * W
    value = np.add.outer((np.arange(W) + 1) * 1_000_003, np.arange(W))
    for me, mem in enumerate(memories):
        assert list(mem[L.CHECK // 8:L.CHECK // 8 + W]) == list(value[:, me])


def test_a_kernel_that_reads_wrong_data_is_named(monkeypatch):
    def wrong(rows, out, width, stream):
        _sum_rows(rows, out, width, stream)
        ctypes.c_int64.from_address(out).value += 1

    verdicts, _ = _run(monkeypatch, sum_rows=wrong)
    assert verdicts == ["a kernel reading peers' workspaces returned wrong data"] * W


def test_one_members_failed_write_is_every_members_verdict_before_anyone_reads(monkeypatch):
    """Rank 1's copy into a peer raises: every member raises Unusable with rank 1's reason
    from the agreement on the writes, and no member reads (the kernel never runs)."""
    ran = []

    def memcpy(dst, src, nbytes, stream):
        if nbytes == 8 and current().default_group.rank() == 1:
            raise RuntimeError("cudaMemcpyAsync: an illegal memory access")
        ctypes.memmove(dst, src, nbytes)

    verdicts, _ = _run(monkeypatch, memcpy=memcpy, sum_rows=lambda *a: ran.append(a))
    assert verdicts == ["Unusable: rank 1: writing into peers' workspaces failed: RuntimeError: cudaMemcpyAsync: "
                        "an illegal memory access"] * W
    assert ran == []


def test_a_kernel_the_driver_cannot_load_leaves_the_reading_to_tritons(monkeypatch):
    """No PTX compiler in the driver (PeerSumUnavailable, nothing enqueued): the same sums
    come from chorus's Triton reduction, and the check passes."""
    used = []

    def unavailable(rows, out, width, stream):
        raise workspace.peer_sum.PeerSumUnavailable("cuModuleLoadData failed: CUresult 221")

    def triton_reduce(rows, offset, out, n, world, op, dtype):
        used.append((n, world, op, dtype))
        _sum_rows(rows.data_ptr(), out, world, 0)

    monkeypatch.setattr(workspace.kernels, "reduce", triton_reduce)
    verdicts, _ = _run(monkeypatch, sum_rows=unavailable)
    assert verdicts == [""] * W and used == [(W, W, "SUM", "int64")] * W


def test_a_failed_read_is_the_verdict_once_the_queued_copies_ran(monkeypatch):
    """The kernel's launch fails after the copies were queued: the verdict names it, and
    the stream is synchronized before it goes out (the members then free their memory)."""
    def failing(rows, out, width, stream):
        raise workspace.peer_sum.PeerSumError("cuLaunchKernel failed: CUresult 700")

    _Stream.synced.clear()
    verdicts, _ = _run(monkeypatch, sum_rows=failing)
    assert verdicts == ["reading peers' workspaces failed: PeerSumError: cuLaunchKernel failed: CUresult 700"] * W
    assert len(_Stream.synced) == 2 * W  # each rank's: after its writes, and before its verdict


def test_the_kernel_refuses_a_width_out_of_range_before_anything_is_enqueued():
    with pytest.raises(ValueError, match="width 0 is outside 1..1024"):
        workspace.peer_sum.sum_rows(0, 0, 0, 0)
    with pytest.raises(ValueError, match="width 1025"):
        workspace.peer_sum.sum_rows(0, 0, workspace.peer_sum.MAX_WIDTH + 1, 0)


def _ptxas(arch: int) -> str | None:
    """Triton's own ptxas for ``arch`` (the one its kernels are built with), or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path
    except Exception:  # noqa: BLE001 - another Triton, or no NVIDIA backend: the test skips
        return None


@pytest.mark.parametrize("arch", [80, 90])
def test_the_kernels_ptx_assembles_for_ampere_and_hopper(arch, tmp_path):
    """The driver compiles peer_sum's PTX at a group's set-up; Triton's ptxas (on any
    machine, no GPU needed) assembles it the same way, so a broken edit fails here."""
    import subprocess

    ptxas = _ptxas(arch)
    if ptxas is None:
        pytest.skip("Triton's ptxas is not installed here")
    source = tmp_path / "peer_sum.ptx"
    source.write_bytes(workspace.peer_sum.PTX.rstrip(b"\0"))
    done = subprocess.run([ptxas, f"-arch=sm_{arch}", str(source), "-o", str(tmp_path / "peer_sum.cubin")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    broken = tmp_path / "broken.ptx"
    broken.write_bytes(source.read_bytes().replace(b"ld.volatile.u64", b"ld.volatle.u64"))
    done = subprocess.run([ptxas, f"-arch=sm_{arch}", str(broken), "-o", str(tmp_path / "broken.cubin")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "volatle" in done.stderr
