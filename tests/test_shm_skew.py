"""Copies at slow offsets (chorus.shm.cma): the rule, the
kernel copies that bounce through a buffer half a page away, whole and after partial
transfers, user-space copies that bounce only where glibc's copy is slow, and single
copy's scratch placed at its source's offset."""

import os
import threading

import numpy as np
import pytest
from cma_support import Ctx

from chorus.shm import cma


def test_slow_is_a_destination_just_past_its_source_within_a_page():
    base = 1 << 20
    assert not cma.slow(base, base)
    for dst_past in (8, 16, 24, 56, 4096 + 16):
        assert cma.slow(base + dst_past, base)
        assert not cma.slow(base, base + dst_past)
    for fine in (64, 80, 256, 2048, 4096 - 16):
        assert not cma.slow(base + fine, base)


def _skewed_pair(nbytes: int, dst_past: int) -> tuple[np.ndarray, np.ndarray]:
    """A source and a destination of ``nbytes`` bytes whose page offsets differ by ``dst_past``."""
    src_mem, dst_mem = np.zeros(nbytes + 8192, np.uint8), np.zeros(nbytes + 8192, np.uint8)
    src = src_mem[(-cma.address(src_mem)) % 4096:][:nbytes]
    dst = dst_mem[(dst_past - cma.address(dst_mem)) % 4096:][:nbytes]
    src[...] = np.arange(nbytes) % 251
    return src, dst


@pytest.mark.parametrize("what", ["read", "write"])
def test_pieces_at_a_slow_skew_go_through_the_bounce_buffer_whole(what, monkeypatch):
    nbytes = 2 * cma.BOUNCE_BYTES + 1000
    src, dst = _skewed_pair(nbytes, 16)
    peers = cma.Peers([os.getpid()] * 2)
    if what == "read":
        assert cma.slow(cma.address(dst), cma.address(src))  # read: the local buffer is written
        peers.read_one(Ctx, 1, cma.address(dst), cma.address(src), nbytes)
    else:
        assert cma.slow(cma.address(dst), cma.address(src))  # write: the remote one is
        peers.write_one(Ctx, 1, cma.address(src), cma.address(dst), nbytes)
    assert np.array_equal(dst, src) and (peers.calls, peers.nbytes) == (3, nbytes)  # 3 bounced pieces
    # the kernel's copies were made at a fast skew: from or into the bounce buffer at the remote's offset
    seen = []
    real = peers.readv if what == "read" else peers.writev

    def spy(pid, local, n, remote, m, flags):
        seen.append(cma.slow(local.base, remote.base) if what == "read" else cma.slow(remote.base, local.base))
        return real(pid, local, n, remote, m, flags)

    real_move, moves = cma.ctypes.memmove, []

    def move_spy(to, frm, size):  # the copy in user space is as slow at those skews
        moves.append(cma.slow(to, frm))
        return real_move(to, frm, size)

    monkeypatch.setattr(peers, "readv" if what == "read" else "writev", spy)
    monkeypatch.setattr(cma.ctypes, "memmove", move_spy)
    dst[...] = 0
    (peers.read_one if what == "read" else peers.write_one)(
        Ctx, 1, *((cma.address(dst), cma.address(src)) if what == "read" else (cma.address(src), cma.address(dst))),
        nbytes)
    assert np.array_equal(dst, src) and seen == [False] * 3 and moves == [False] * 3


def test_a_bounced_piece_goes_on_after_a_partial_transfer():
    nbytes = cma.BOUNCE_BYTES + 4096
    src, dst = _skewed_pair(nbytes, 8)
    peers = cma.Peers([os.getpid()] * 2)
    real, cut = peers.readv, []

    def first_half(pid, local, n, remote, m, flags):
        if not cut:
            cut.append(local.len)
            local.len = remote.len = local.len // 2
        return real(pid, local, n, remote, m, flags)

    peers.readv = first_half
    peers.read_one(Ctx, 1, cma.address(dst), cma.address(src), nbytes)
    assert np.array_equal(dst, src) and cut == [cma.BOUNCE_BYTES]


@pytest.mark.parametrize("nbytes", [1000, 64 << 10, (100 << 10) + 3, 300 << 10, 1 << 20])
@pytest.mark.parametrize("dst_past", [0, 16, 40, 2048])
def test_skew_copy_copies_whole_and_bounces_only_slow_copies_in_its_range(nbytes, dst_past):
    src, dst = _skewed_pair(nbytes, dst_past)
    bounced = []

    def run():
        cma.copy(dst, src)
        bounced.append("bounce" in cma._local.__dict__)  # a fresh thread: its own buffer

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert np.array_equal(dst, src)
    assert bounced == [dst_past in (16, 40) and cma.MIN_BYTES <= nbytes < cma.MAX_BYTES]
    wide = src[: nbytes // 4 * 4].view(np.float32)  # other dtypes: copied as bytes
    out = np.zeros_like(wide)
    cma.copy(out, wide)
    assert out.tobytes() == wide.tobytes()


def test_scratch_starts_at_the_page_offset_asked_for_and_is_reused():
    peers = cma.Peers([os.getpid()] * 2)
    first = peers.scratch(10_000, like=0x1234)
    assert first.size == 10_000 and cma.address(first) % 4096 == 0x234
    again = peers.scratch(5_000, like=0x10)
    assert cma.address(again) % 4096 == 0x10 and again.base is first.base


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


@pytest.mark.parametrize("make", [
    lambda: np.arange(100, dtype=np.float32),             # through ctypes' view of the buffer
    lambda: np.arange(100, dtype=np.float32)[3:],          # a view starting inside its base
    lambda: np.arange(100, dtype=np.float16)[::2],         # not contiguous: numpy's interface
    lambda: np.empty(0, np.float64),                       # empty: numpy's interface
    lambda: _read_only(np.arange(10, dtype=np.int64)[1:]),  # read-only: numpy's interface
], ids=["whole", "view", "strided", "empty", "read-only"])
def test_address_is_where_numpy_says_the_data_starts(make):
    arr = make()
    assert cma.address(arr) == arr.__array_interface__["data"][0]
    assert cma.address(None) == 0
