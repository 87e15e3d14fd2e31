"""The fused all_reduce kernels of chorus.cuda alone on one GPU: a group of one rank over a
workspace of this process, so every barrier passes at once and what is left is each
kernel's own cost.  GPU time per launch of back-to-back launches, by size (bf16) and by
grid (the one-shot kernel of 128 Ki elements on 1 .. 64 blocks).  Needs a CUDA GPU,
triton and cuda-bindings.

    python3 tools/cuda_fused_alone.py [--iters 50]
"""

from __future__ import annotations

import argparse
import sys

import torch

from chorus.cuda import launchers as K
from chorus.cuda import layout as L
from chorus.cuda import runtime as R

SIZES = (1024, 8192, 32768, 131072, 524288, 2097152)


class Alone:
    """One rank's workspace and control page, and the epochs of its barriers."""

    def __init__(self, total: int = 64 << 20):
        self.ws = R.malloc(total)
        self.host = R.host_alloc(L.CONTROL_WORDS * 8)
        self.words = R.host_words(self.host, L.CONTROL_WORDS)
        self.words[:] = 0
        torch.as_tensor(R.DeviceArray(self.ws, total), device="cuda").zero_()
        self.controls = torch.tensor([self.ws], dtype=torch.int64, device="cuda")
        self.layout = L.Layout.of(1, total)
        self.epoch = 0

    def fused(self, kind: str, x) -> None:
        e = self.epoch + 1
        self.epoch += K.all_reduce_fused(kind, x.data_ptr(), x.data_ptr(), x.numel(), self.controls.data_ptr(),
                                         self.layout.slot_at(e & 1), 0, 1, self.host, e, 7, e, 10 ** 10, "SUM",
                                         "bfloat16")

    def reduce(self, x) -> None:
        rows = torch.tensor([self.ws + self.layout.slot_at(0)], dtype=torch.int64, device="cuda")
        K.reduce(rows, 0, x.data_ptr(), x.numel(), 1, "SUM", "bfloat16")


def per_launch_us(launch, x, iters: int) -> float:
    for _ in range(3):
        launch(x)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        launch(x)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / iters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_fused_alone.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    me = Alone()
    for n in SIZES:
        x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        grid, per = L.one_shot_geometry(n)
        one = per_launch_us(lambda t: me.fused("one_shot", t), x, args.iters)
        two = per_launch_us(lambda t: me.fused("two_shot", t), x, args.iters)
        red = per_launch_us(me.reduce, x, args.iters)
        print(f"n={n:>8} one_shot grid={grid:>3} per={per:>6}: {one:8.1f} us  two_shot {two:8.1f} us  "
              f"reduce_kernel {red:7.1f} us  status {int(me.words[L.STATUS])}")
    n = 131072
    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    whole = L.one_shot_geometry
    try:
        for blocks in (1, 4, 16, 64):
            L.one_shot_geometry = lambda count, max_blocks=blocks: whole(count, max_blocks)  # noqa: E731
            K.clear_plans()  # the plans hold the geometry
            t = per_launch_us(lambda v: me.fused("one_shot", v), x, args.iters)
            print(f"max_blocks={blocks:>3} n={n} grid={L.one_shot_geometry(n)[0]}: {t:8.1f} us "
                  f"status {int(me.words[L.STATUS])}")
    finally:
        L.one_shot_geometry = whole
        K.clear_plans()
    return 0


if __name__ == "__main__":
    sys.exit(main())
