"""chorus.cuda's Triton kernels, run by Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1; skipped without triton).  Addresses are host addresses, which the
interpreter dereferences as the GPU would device ones."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="triton is not installed (pip install 'chorus[cuda]')")

from cuda_emulation import reference  # noqa: E402

from chorus.cuda import launchers as K  # noqa: E402
from chorus.cuda import layout as L  # noqa: E402

if not K.INTERPRET:
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool"]
DTYPES += [d for d in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, d)]


def rows_of(tensors, offset=0):
    return torch.tensor([t.data_ptr() - offset for t in tensors], dtype=torch.int64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_every_op(dtype):
    world, n = 3, 2500  # two programs, the second partial
    rows = [((torch.arange(n) * (r + 2) + r) % 4 - (0 if dtype.startswith(("uint", "bool")) else 1))
            for r in range(world)]
    rows = [(t > 0) if dtype == "bool" else t.to(getattr(torch, dtype)) for t in rows]
    floating = rows[0].is_floating_point()
    for op in OPS:
        if floating and op in ("BAND", "BOR", "BXOR"):
            continue
        out = torch.empty_like(rows[0])
        K.reduce(rows_of(rows, 64), 64, out.data_ptr(), n, world, op, dtype)  # offset: added to every row
        want = reference(rows, op)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (dtype, op)


def test_reduce_accumulates_16_bit_floats_in_float32():
    for dtype in (torch.bfloat16, torch.float16):
        big = 256.0 if dtype == torch.bfloat16 else 2048.0  # one more is exactly half a step
        rows = [torch.full((5,), big, dtype=dtype), torch.ones(5, dtype=dtype), torch.ones(5, dtype=dtype)]
        assert (rows[0] + rows[1] + rows[2])[0] == big  # rounded at every step: the ones vanish
        out = torch.empty(5, dtype=dtype)
        K.reduce(rows_of(rows), 0, out.data_ptr(), 5, 3, "AVG", str(dtype)[6:])  # AVG reduces as SUM
        assert torch.equal(out, torch.full((5,), big + 2, dtype=dtype))


class Pads:
    """W workspaces' control regions and a control page for rank 0, in host memory."""

    def __init__(self, world):
        self.world = world
        self.ws = [torch.zeros(L.CONTROL_BYTES // 8, dtype=torch.int64) for _ in range(world)]
        self.controls = torch.tensor([w.data_ptr() for w in self.ws])
        self.host = torch.zeros(L.CONTROL_WORDS, dtype=torch.int64)

    def barrier_words(self, r):
        return self.ws[r][L.BARRIER // 8: L.BARRIER // 8 + self.world].tolist()

    def barrier(self, op_id=7, max_spins=200, fprint=0):
        K.barrier(self.controls, 0, self.world, self.host.data_ptr(), op_id, 10**12, max_spins, fprint)

    def fprint_words(self, r, parity):
        at = (L.FPRINT + parity * L.FPRINT_PARITY) // 8
        return self.ws[r][at: at + self.world]


def test_barrier_epochs_timeout_abort():
    p = Pads(3)
    p.ws[0][L.BARRIER // 8 + 1] = 1  # ranks 1 and 2 already reached epoch 1
    p.ws[0][L.BARRIER // 8 + 2] = 1
    p.barrier()
    assert p.ws[0][0] == 1 and p.host[L.STATUS] == 0
    assert [p.barrier_words(r)[0] for r in range(3)] == [1, 1, 1]  # epoch 1 pushed to every rank
    p.ws[0][L.BARRIER // 8 + 2] = 5  # rank 2 ahead (it may be): only rank 1 is missing at epoch 2
    p.barrier(op_id=8)
    assert p.host[L.STATUS] == L.TIMEOUT
    assert (p.host[L.FAIL_OP], p.host[L.FAIL_WHAT], p.host[L.FAIL_PEERS]) == (8, L.WAIT_BARRIER, 0b010)
    p.barrier(op_id=9)  # broken: returns at once, changes nothing
    assert p.ws[0][0] == 2 and p.host[L.FAIL_OP] == 8

    p = Pads(2)
    p.host[L.ABORT] = 1
    p.barrier(max_spins=10**9)  # the abort word ends the spin, not the spin count
    assert p.host[L.STATUS] == L.ABORTED and p.host[L.FAIL_PEERS] == 0b10


def test_barrier_compares_fingerprints():
    """Every rank stores its op's fingerprint next to its epoch; a rank whose fingerprint
    differs from this rank's is reported (MISMATCH, its bit, its fingerprint)."""
    from chorus.wire.fingerprint import fingerprint

    mine = fingerprint("all_reduce", "float32", 1 << 32, -1, "SUM")  # >= 2**63: stored as a negative word
    theirs = fingerprint("all_gather", "float32", 1000)
    assert mine >= 1 << 63
    p = Pads(4)
    for r in (1, 2, 3):  # epoch 1 (parity 1): every peer arrived, rank 2 with another op
        p.ws[0][L.BARRIER // 8 + r] = 1
        p.fprint_words(0, 1)[r] = K.signed64(theirs if r == 2 else mine)
    p.barrier(op_id=5, fprint=mine)
    assert [int(p.fprint_words(r, 1)[0]) for r in range(4)] == [K.signed64(mine)] * 4  # pushed everywhere
    assert (p.host[L.STATUS], p.host[L.FAIL_OP], p.host[L.FAIL_WHAT]) == (L.MISMATCH, 5, L.WAIT_BARRIER)
    assert p.host[L.FAIL_PEERS] == 0b0100 and int(p.host[L.FAIL_FP]) == theirs

    p = Pads(2)  # the same op everywhere: nothing to report, at either parity
    for epoch in (1, 2):
        p.ws[0][L.BARRIER // 8 + 1] = epoch
        p.fprint_words(0, epoch & 1)[1] = K.signed64(mine)
        p.barrier(op_id=epoch, fprint=mine)
        assert p.host[L.STATUS] == 0, epoch
    p.fprint_words(0, 0)[1] = K.signed64(theirs)  # rank 1's next op, at the other parity: not read
    p.ws[0][L.BARRIER // 8 + 1] = 3
    p.barrier(op_id=3, fprint=mine)  # epoch 3 reads parity 1
    assert p.host[L.STATUS] == 0


def test_post_and_wait_with_headers():
    p = Pads(2)
    host = p.host.data_ptr()
    flag = p.ws[1].data_ptr() + L.READY  # rank 1's READY[0]
    hdr = p.ws[0].data_ptr() + L.CHANNEL_HEADER * 4  # somewhere in rank 0's memory
    K.post(flag, 3, host, hdr, 42, 100)
    assert p.ws[1][L.READY // 8] == 3 and p.ws[0][hdr_index(p, hdr): hdr_index(p, hdr) + 2].tolist() == [42, 100]
    K.wait(flag, 3, 0, host, 11, L.WAIT_READY, 10**12, hdr, 42, 100, max_spins=100)
    assert p.host.tolist() == [0] * L.CONTROL_WORDS
    K.wait(flag, 2, 0, host, 12, L.WAIT_READY, 10**12, hdr, 41, 100, max_spins=100)  # another tag: recorded
    assert p.host[L.STATUS] == 0
    assert p.host[L.TAG_OP: L.TAG_GOT + 1].tolist() == [13, 0, 41, 42]
    K.wait(flag, 4, 0, host, 14, L.WAIT_READY, 10**12, max_spins=100)  # chunk 4 never posted
    assert p.host[L.STATUS] == L.TIMEOUT and p.host[L.FAIL_OP] == 14 and p.host[L.FAIL_PEERS] == 1
    p.host.zero_()
    K.wait(flag, 3, 1, host, 15, L.WAIT_READY, 10**12, hdr, 42, 99, max_spins=100)  # another size
    assert (p.host[L.STATUS], p.host[L.FAIL_EXPECT], p.host[L.FAIL_GOT], p.host[L.FAIL_PEERS]) == \
        (L.SIZE_MISMATCH, 99, 100, 0b10)
    K.post(flag, 9, host)  # broken: no post
    assert p.ws[1][L.READY // 8] == 3


def hdr_index(p, hdr):
    return (hdr - p.ws[0].data_ptr()) // 8


# -- the fused all_reduce kernels ----------------------------------------------------------------
class Fused:
    """W workspaces (control words and two slots) in host memory, and a control page per
    rank.  The interpreter runs one kernel at a time, so the ranks run one after the other:
    ``arrive`` first makes it look as if every peer had already reached the epochs (its
    words, its slot's data), as the peers' kernels would on a GPU."""

    def __init__(self, world, slot=1 << 15):
        self.world, self.slot = world, slot
        self.ws = [torch.zeros((L.CONTROL_BYTES + 2 * slot) // 8, dtype=torch.int64) for _ in range(world)]
        self.controls = torch.tensor([w.data_ptr() for w in self.ws])
        self.hosts = [torch.zeros(L.CONTROL_WORDS, dtype=torch.int64) for _ in range(world)]

    def slot_view(self, r, parity, dtype, n):
        at = L.CONTROL_BYTES + parity * self.slot
        return self.ws[r].view(torch.uint8)[at: at + n * dtype.itemsize].view(dtype)

    def arrive(self, blocks, epochs, fprint, skip=()):
        for r in range(self.world):
            for b in range(blocks):
                for q in range(self.world):
                    if (q, b) in skip:
                        continue
                    for e in epochs:
                        self.ws[r][L.block_barrier(b) // 8 + q] = e
                        self.ws[r][L.block_fprint(b, e & 1) // 8 + q] = K.signed64(fprint)

    def run(self, kind, r, inp, out, parity, epoch, fprint, op="SUM", max_spins=200, warps=4, blocks=L.MAX_BLOCKS):
        return K.all_reduce_fused(kind, inp.data_ptr(), out.data_ptr(), inp.numel(), self.controls.data_ptr(),
                                  L.CONTROL_BYTES + parity * self.slot, r, self.world, self.hosts[r].data_ptr(), 9,
                                  fprint, epoch, 10**12, op, str(inp.dtype)[6:], max_spins, warps=warps, blocks=blocks)


# every dtype at W = 2; W = 3 (not a power of two) with the widened and the boolean
# reductions, which are where the rank count enters the arithmetic
@pytest.mark.parametrize("dtype, world", [("bfloat16", 2), ("bfloat16", 3), ("float32", 2), ("int32", 2),
                                          ("bool", 2), ("bool", 3), ("float16", 2)])
def test_one_shot_kernel(dtype, world):
    """Every rank's output is op over every rank's input in rank order (bit for bit), its
    input landed in its slot, and it pushed its epoch and fingerprint into every rank's
    words of every block."""
    n = 2500  # three blocks, the last partial
    dt = getattr(torch, dtype)
    ins = [((torch.arange(n) * (r + 2) + r) % 4 - (0 if dtype == "bool" else 1)) for r in range(world)]
    ins = [(t > 0) if dtype == "bool" else t.to(dt) for t in ins]
    f = Fused(world)
    blocks, _ = L.one_shot_geometry(n)
    assert blocks == 3
    fp = (1 << 63) + 12345  # a negative word
    for op in ("SUM", "MAX") if dtype != "bool" else ("SUM", "PRODUCT"):
        for q in range(world):
            f.slot_view(q, 1, dt, n).copy_(ins[q])
        f.arrive(blocks, [7], fp)
        outs = [torch.empty_like(ins[0]) for _ in range(world)]
        for r in range(world):
            assert f.run("one_shot", r, ins[r], outs[r], 1, 7, fp, op) == 1
            assert f.hosts[r].tolist() == [0] * L.CONTROL_WORDS, (r, f.hosts[r])
        want = reference(ins, op)
        for r in range(world):
            assert torch.equal(outs[r].view(torch.uint8), want.view(torch.uint8)), (op, r)
            assert torch.equal(f.slot_view(r, 1, dt, n), ins[r])
            assert int(f.ws[r][0]) == 7  # EPOCH, from block 0
            for b in range(blocks):
                assert f.ws[r][L.block_barrier(b) // 8: L.block_barrier(b) // 8 + world].tolist() == [7] * world


@pytest.mark.parametrize("warps,blocks", [(1, 128), (2, 2), (8, 128)])
def test_one_shot_kernel_of_other_shapes(warps, blocks):
    """CHORUS_CUDA_FUSED_WARPS / _BLOCKS: a step of 256 x warps elements, at most
    ``blocks`` blocks; the same result, and the same blocks' words pushed."""
    world, n, dt = 2, 2500, torch.float32
    ins = [((torch.arange(n) * (r + 2) + r) % 4 - 1).to(dt) for r in range(world)]
    count, _ = L.one_shot_geometry(n, blocks, 256 * warps)
    assert count == min(blocks, -(-n // (256 * warps)))
    f = Fused(world)
    for q in range(world):
        f.slot_view(q, 0, dt, n).copy_(ins[q])
    f.arrive(count, [3], 5)
    outs = [torch.empty_like(ins[0]) for _ in range(world)]
    for r in range(world):
        assert f.run("one_shot", r, ins[r], outs[r], 0, 3, 5, warps=warps, blocks=blocks) == 1
        assert f.hosts[r][L.STATUS] == 0 and torch.equal(outs[r], reference(ins, "SUM"))
        for b in range(count):
            assert f.ws[r][L.block_barrier(b) // 8: L.block_barrier(b) // 8 + world].tolist() == [3] * world
    with pytest.raises(ValueError, match="needs 40 threads"):
        Fused(40).run("one_shot", 0, ins[0], outs[0], 0, 3, 5, warps=1)


@pytest.mark.parametrize("world", [2, 4])
def test_two_shot_kernel_in_place(world):
    """Two-shot in place: each rank reduces its slice into its slot and output, then copies
    the others' slices from their slots (here prepared as their kernels would leave them)."""
    n = 4100  # slices of 2112 / 1088 elements: several blocks per slice, a short last slice
    dt = torch.bfloat16
    ins = [(((torch.arange(n) * 7 + r * 3) % 5) - 1).to(dt) for r in range(world)]
    want = reference(ins, "SUM")
    blocks, per, piece = L.two_shot_geometry(n, world)
    f = Fused(world)
    for q in range(world):
        s = f.slot_view(q, 0, dt, n)
        s.copy_(ins[q])
        s[q * piece: (q + 1) * piece] = want[q * piece: (q + 1) * piece]
    f.arrive(blocks, [4, 5], 77)
    bufs = [t.clone() for t in ins]
    for r in range(world):
        assert f.run("two_shot", r, bufs[r], bufs[r], 0, 4, 77) == 2
        assert f.hosts[r][L.STATUS] == 0
    for r in range(world):
        assert torch.equal(bufs[r], want), r
        assert torch.equal(f.slot_view(r, 0, dt, n)[r * piece: (r + 1) * piece], want[r * piece: (r + 1) * piece])


def test_fused_kernels_report_timeout_mismatch_and_skip_when_broken():
    n = 3000
    x = torch.ones(n)
    out = torch.zeros(n)
    blocks, _ = L.one_shot_geometry(n)
    f = Fused(2)
    f.arrive(blocks, [1], 5, skip={(1, 2)})  # rank 1's block 2 never arrives
    f.run("one_shot", 0, x, out, 1, 1, 5)
    h = f.hosts[0]
    assert (h[L.STATUS], h[L.FAIL_OP], h[L.FAIL_WHAT], h[L.FAIL_PEERS]) == (L.TIMEOUT, 9, L.WAIT_BARRIER, 0b10)
    assert torch.equal(out[:2048], torch.ones(2048))  # blocks 0 and 1 finished (rank 1's slot: zeros)
    assert torch.equal(out[2048:], torch.zeros(n - 2048))
    before = f.ws[1].clone()
    f.run("one_shot", 0, x, out, 0, 2, 5)  # broken: does nothing at all
    assert torch.equal(f.ws[1], before)

    f = Fused(2)  # rank 1 called another op: block 0 reports it; no block reads the slots
    blocks, _, _ = L.two_shot_geometry(n, 2)
    f.arrive(blocks, [3], 5)
    f.ws[0][L.block_fprint(0, 1) // 8 + 1] = 6
    for b in range(1, blocks):
        f.ws[0][L.block_fprint(b, 1) // 8 + 1] = 6
    out.zero_()
    f.run("two_shot", 0, x, out, 0, 3, 5)
    h = f.hosts[0]
    assert (h[L.STATUS], h[L.FAIL_PEERS], h[L.FAIL_FP]) == (L.MISMATCH, 0b10, 6)
    assert not out.any()


def test_barrier_with_host_epoch():
    p = Pads(2)
    p.ws[0][L.BARRIER // 8 + 1] = 5
    K.barrier(p.controls, 0, 2, p.host.data_ptr(), 1, 10**12, 200, 0, epoch=5)
    assert p.host[L.STATUS] == 0 and p.ws[0][0] == 5 and p.ws[1][L.BARRIER // 8] == 5


def _two_shot_case(world):
    """4100 bf16 elements a rank (slices of several blocks, a short last one), the ranks'
    inputs and their sum, and workspaces whose peers already reached epochs 4 and 5."""
    n = 4100
    dt = torch.bfloat16
    ins = [(((torch.arange(n) * 7 + r * 3) % 5) - 1).to(dt) for r in range(world)]
    blocks, _, piece = L.two_shot_geometry(n, world, step=32 * 16 * 4)
    f = Fused(world)
    f.arrive(blocks, [4, 5], 77)
    return n, dt, ins, reference(ins, "SUM"), piece, f


def _two_shot_run(f, kind, r, inp, out):
    """Rank r's two-shot kernel ``kind``, 16 elements a thread, epochs 4 and 5."""
    return K.all_reduce_fused(kind, inp.data_ptr(), out.data_ptr(), inp.numel(), f.controls.data_ptr(),
                              L.CONTROL_BYTES, r, f.world, f.hosts[r].data_ptr(), 9, 77, 4, 10**12, "SUM",
                              "bfloat16", 200, per_thread=16)


@pytest.mark.parametrize("world", [2, 3])
def test_two_shot_push_kernel_stores_its_slice_everywhere(world):
    """Two-shot with the all-gather by stores: rank r reduces slice r (reading every slot),
    stores it into every rank's slot and its output, then copies the other slices out of
    its own slot.  Ranks run one at a time here, so each rank's own slot holds its input
    when it copies out (its copy-in came last): that is what its output must show."""
    n, dt, ins, want, piece, f = _two_shot_case(world)
    for r in range(world):
        for q in range(world):  # the peers' inputs, as their copy-in leaves them
            f.slot_view(q, 0, dt, n)[r * piece: (r + 1) * piece] = ins[q][r * piece: (r + 1) * piece]
        out = torch.full((n,), -9.0, dtype=dt)
        assert _two_shot_run(f, "two_shot_push", r, ins[r], out) == 2
        assert f.hosts[r][L.STATUS] == 0
        mine = slice(r * piece, (r + 1) * piece)
        for q in range(world):
            assert torch.equal(f.slot_view(q, 0, dt, n)[mine], want[mine]), (r, q)
        expect = ins[r].clone()
        expect[mine] = want[mine]
        assert torch.equal(out, expect), r
    with pytest.raises(ValueError, match="power of two"):
        K.all_reduce_fused("two_shot_push", 0, 0, n, f.controls.data_ptr(), L.CONTROL_BYTES, 0, world,
                           f.hosts[0].data_ptr(), 9, 77, 4, 10**12, "SUM", "bfloat16", 200, per_thread=12)


@pytest.mark.parametrize("world", [2, 3])
def test_two_shot_stores_kernel_rows_and_gathers(world):
    """Only stores cross the links: rank r writes slice q of its input into row r of rank
    q's slot, reduces its own rows, stores the result into every other rank's gather row
    r, and copies the other slices out of its own gather rows.  Ranks run one at a time,
    so the peers' rows and gathers are laid out before each rank runs, as their kernels
    would leave them."""
    n, dt, ins, want, piece, f = _two_shot_case(world)

    def cut(t, s):
        return t[s * piece: min((s + 1) * piece, n)]

    for r in range(world):
        mine = f.slot_view(r, 0, dt, 2 * world * piece)
        for q in range(world):  # rank q's row in my slot, and its reduced slice in my gather q
            row = cut(ins[q], r)
            mine[q * piece: q * piece + row.numel()] = row
            if q != r:
                g = cut(want, q)
                mine[(world + q) * piece: (world + q) * piece + g.numel()] = g
        out = torch.full((n,), -9.0, dtype=dt)
        assert _two_shot_run(f, "two_shot_stores", r, ins[r], out) == 2
        assert f.hosts[r][L.STATUS] == 0 and torch.equal(out, want), r
        for q in range(world):
            theirs = f.slot_view(q, 0, dt, 2 * world * piece)
            assert torch.equal(theirs[r * piece: r * piece + cut(ins[r], q).numel()], cut(ins[r], q)), (r, q)
            if q != r:
                g = cut(want, r)
                assert torch.equal(theirs[(world + r) * piece: (world + r) * piece + g.numel()], g), (r, q)


@pytest.mark.parametrize("dtype, world, replay", [("float32", 2, False), ("bfloat16", 2, False),
                                                  ("bfloat16", 3, False), ("bfloat16", 3, True)])
def test_fused_all_gather_and_reduce_scatter_kernels(world, dtype, replay):
    """chorus.cuda.gather: rank r stores its part into row r of the peers' slots and reads
    the rows of its own.  Ranks run one at a time, so every slot's rows are laid out
    first as the peers' kernels would leave them (rank r's own stores write the same).
    ``replay``: the kernels' replay mode (chorus.cuda.replays): epoch 0 and op id
    REPLAY_OP passed, the epoch read from the EPOCH word + 1, which the last block then
    stores; a peer that never arrives is reported under REPLAY_OP + that epoch."""
    n = 2500  # three blocks of 1024, the last partial; rows GRAIN-aligned
    stride = -(-n // L.GRAIN) * L.GRAIN
    dt = getattr(torch, dtype)
    ins = [((torch.arange(n) * (r + 2) + r) % 7 - 3).to(dt) for r in range(world)]
    rs_ins = [((torch.arange(world * n) * (r + 3) + 1) % 5 - 2).to(dt) for r in range(world)]
    blocks, _ = L.one_shot_geometry(n)
    f = Fused(world, slot=2 * world * stride * 4)

    def rows(p):
        return f.slot_view(p, 0, dt, world * stride).view(world, stride)

    for kind in ("all_gather", "reduce_scatter"):
        for p in range(world):
            for q in range(world):
                rows(p)[q, :n] = ins[q] if kind == "all_gather" else rs_ins[q][p * n:(p + 1) * n]
        epoch = 6 if kind == "all_gather" else 7
        f.arrive(blocks, [epoch], 31)
        want = reference(rs_ins, "SUM")
        for r in range(world):
            src = ins[r] if kind == "all_gather" else rs_ins[r]
            out = torch.full((world * n if kind == "all_gather" else n,), -9.0, dtype=dt)
            f.ws[r][L.EPOCH // 8] = epoch - 1 if replay else 0
            assert K.rows_fused(kind, src.data_ptr(), out.data_ptr(), n, stride, n, f.controls.data_ptr(),
                                L.CONTROL_BYTES, r, world, f.hosts[r].data_ptr(), L.REPLAY_OP if replay else 9, 31,
                                0 if replay else epoch, 10**12, "SUM", dtype, dt.itemsize, 200, replay=replay) == 1
            assert f.hosts[r][L.STATUS] == 0, (kind, r)
            # EPOCH: the eager kernel's block 0 stores its epoch at its start, the replay's last block at its end
            assert (int(f.ws[r][L.EPOCH // 8]), int(f.ws[r][L.REPLAY_DONE // 8])) == (epoch, 0), (kind, r)
            if kind == "all_gather":
                assert torch.equal(out, torch.cat(ins)), r
            else:
                assert torch.equal(out, want[r * n:(r + 1) * n]), r
        if replay:  # nobody arrives at the next epoch: a timeout, named by the replayed op's first epoch
            g = Fused(world, slot=f.slot)
            g.ws[0][L.EPOCH // 8] = epoch
            out = torch.empty(world * n if kind == "all_gather" else n, dtype=dt)
            K.rows_fused(kind, src.data_ptr(), out.data_ptr(), n, stride, n, g.controls.data_ptr(), L.CONTROL_BYTES,
                         0, world, g.hosts[0].data_ptr(), L.REPLAY_OP, 31, 0, 10**12, "SUM", dtype, dt.itemsize, 50,
                         replay=True)
            assert g.hosts[0][L.STATUS] == L.TIMEOUT and int(g.hosts[0][L.FAIL_OP]) == L.REPLAY_OP + epoch + 1


# -- captured in a CUDA graph: rounds and epochs counted on the device ---------------------------
@pytest.mark.parametrize("ops", [5, 6])
def test_captured_kernels_count_on_the_device(ops):
    """A captured launch (graph_slot > 0) takes its slot parity from GRAPH_OPS and its
    epochs from GRAPH_EPOCH, uses the graph area's per-block words, leaves the eager
    words alone, and its last block advances both counts and resets GRAPH_DONE: the
    arguments frozen at capture stay right on every replay."""
    world, n, dt = 2, 2500, torch.float32
    ins = [((torch.arange(n) * (r + 2) + r) % 4 - 1).to(dt) for r in range(world)]
    f = Fused(world)
    blocks, _ = L.one_shot_geometry(n)
    parity, epoch = ops & 1, 41
    for r in range(world):
        f.ws[r][L.GRAPH_OPS // 8], f.ws[r][L.GRAPH_EPOCH // 8] = ops, epoch - 1
        f.slot_view(r, parity, dt, n).copy_(ins[r])  # the peers' copy-in (ranks run in turn here)
        for b in range(blocks):
            for q in range(world):
                f.ws[r][L.graph_barrier(b) // 8 + q] = epoch
                f.ws[r][L.graph_fprint(b, epoch & 1) // 8 + q] = 77
    outs = [torch.empty_like(ins[0]) for _ in range(world)]
    for r in range(world):
        K.all_reduce_fused("one_shot", ins[r].data_ptr(), outs[r].data_ptr(), n, f.controls.data_ptr(),
                           L.CONTROL_BYTES, r, world, f.hosts[r].data_ptr(), 9, 77, 0, 10**12, "SUM", "float32", 200,
                           graph_slot=f.slot)
        assert f.hosts[r][L.STATUS] == 0, f.hosts[r]
    for r in range(world):
        assert torch.equal(outs[r], reference(ins, "SUM")), r
        assert torch.equal(f.slot_view(r, parity, dt, n), ins[r])
        words = f.ws[r]
        assert (words[L.GRAPH_OPS // 8], words[L.GRAPH_EPOCH // 8], words[L.GRAPH_DONE // 8]) == (ops + 1, epoch, 0)
        assert int(words[0]) == 0 and int(words[L.BARRIER // 8]) == 0  # the eager words: untouched
    # a peer that never arrives: the captured kernel times out like an eager one, and reports it
    g = Fused(world)
    out = torch.empty_like(ins[0])
    K.all_reduce_fused("one_shot", ins[0].data_ptr(), out.data_ptr(), n, g.controls.data_ptr(), L.CONTROL_BYTES, 0,
                       world, g.hosts[0].data_ptr(), 9, 77, 0, 10**12, "SUM", "float32", 50, graph_slot=g.slot)
    assert g.hosts[0][L.STATUS] == L.TIMEOUT
    assert int(g.ws[0][L.GRAPH_OPS // 8]) == 1 and int(g.ws[0][L.GRAPH_DONE // 8]) == 0


# -- a lane's replay: eager words and slots, the epoch and op id from the device ----------------
@pytest.mark.parametrize("kind", ["one_shot", "two_shot_push"])
def test_a_replayed_kernel_takes_its_epoch_from_the_device_and_names_its_op_by_it(kind):
    """The replay kernel (replay=True: its arguments frozen in a graph, epoch 0) reads
    EPOCH + 1 as its first epoch, meets its peers at the eager per-block words of that
    epoch (as the same op launched eagerly would), leaves EPOCH alone until its last
    block stores the last epoch it used and resets REPLAY_DONE; a peer that never
    arrives gets a timeout reported under op id REPLAY_OP + the first epoch."""
    world, n, dt = 2, 2500, torch.float32
    barriers = 1 if kind == "one_shot" else 2
    ins = [((torch.arange(n) * (r + 2) + r) % 4 - 1).to(dt) for r in range(world)]
    want = reference(ins, "SUM")
    f = Fused(world)
    first = 41
    blocks = L.one_shot_geometry(n)[0] if kind == "one_shot" else L.two_shot_geometry(n, world)[0]
    f.arrive(blocks, range(first, first + barriers), 77)
    piece = L.two_shot_geometry(n, world)[2]
    for r in range(world):
        f.ws[r][L.EPOCH // 8] = first - 1  # the eager kernels' count so far
        for q in range(world):  # the peers' copy-in (ranks run in turn here)
            f.slot_view(q, 1, dt, n).copy_(ins[q])
        out = torch.full((n,), -9.0, dtype=dt)
        used = K.all_reduce_fused(kind, ins[r].data_ptr(), out.data_ptr(), n, f.controls.data_ptr(),
                                  L.CONTROL_BYTES + f.slot, r, world, f.hosts[r].data_ptr(), L.REPLAY_OP, 77, 0,
                                  10**12, "SUM", "float32", 200, replay=True)
        assert used == barriers and f.hosts[r][L.STATUS] == 0, f.hosts[r]
        mine = slice(None) if kind == "one_shot" else slice(r * piece, (r + 1) * piece)  # (what it reduced)
        assert torch.equal(out[mine], want[mine]), r
        words = f.ws[r]
        assert (int(words[L.EPOCH // 8]), int(words[L.REPLAY_DONE // 8])) == (first + barriers - 1, 0)
        assert int(words[L.GRAPH_OPS // 8]) == 0 and int(words[L.GRAPH_EPOCH // 8]) == 0  # the graph counts: untouched
    g = Fused(world)
    g.ws[0][L.EPOCH // 8] = 6
    out = torch.empty_like(ins[0])
    K.all_reduce_fused(kind, ins[0].data_ptr(), out.data_ptr(), n, g.controls.data_ptr(), L.CONTROL_BYTES, 0, world,
                       g.hosts[0].data_ptr(), L.REPLAY_OP, 77, 0, 10**12, "SUM", "float32", 50, replay=True)
    assert g.hosts[0][L.STATUS] == L.TIMEOUT and int(g.hosts[0][L.FAIL_OP]) == L.REPLAY_OP + 7


def test_a_first_launch_goes_on_the_stream_asked_for(monkeypatch):
    """Triton launches on torch's current stream; a launch asked for on another stream
    (the barrier beside an NCCL hand-off) has that stream made current around it, also
    the first launch of its key, which goes through Triton; on the current stream
    nothing is switched."""
    current = [7]
    launched_on, switched = [], []

    class Switch:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            switched.append(self.stream)
            current.append(self.stream)

        def __exit__(self, *exc):
            current.pop()

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, num_warps: launched_on.append(current[-1])

    monkeypatch.setattr(K, "INTERPRET", False)
    monkeypatch.setattr(K, "FAST", False)
    monkeypatch.setattr(K, "_raw_stream", lambda: current[-1])
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda raw: raw)
    monkeypatch.setattr(torch.cuda, "stream", Switch)
    K.launch(Kernel(), ("k",), 1, (), 1, stream=9)
    K.launch(Kernel(), ("k",), 1, (), 1, stream=7)
    K.launch(Kernel(), ("k",), 1, (), 1)
    assert launched_on == [9, 7, 7] and switched == [9]
