"""What the pieces of an eager CUDA collective cost the CPU, one process per GPU: torch's
calls the lane makes (stream, device, capture state, tensor attributes), a kernel launch
through Triton and through chorus.cuda.direct's parameter block (1 and 16 parameters),
cuGraphLaunch of a graph holding that kernel (alone, two alternating, and through a PyDLL
entry point that keeps the GIL) and torch's replay of it; then chorus's
all_reduce, all_gather_into_tensor, reduce_scatter_tensor and broadcast of 1024 bf16
elements (and torch's NCCL all_gather_into_tensor), and a cProfile of 2000 calls of the
first three.  Each row: the best of 3 rounds of CPU us per call.  Each rank writes
OUT/probe-rankR.txt.

usage: python3 tools/cuda_launch_probe.py OUT [PORT]
"""
from __future__ import annotations

import cProfile
import ctypes
import io
import itertools
import os
import pstats

import torch
from cuda_handoff_cost import init_both, spawn_per_gpu
from cuda_lane_cost import cpu_per_call as cpu


def body(rank, world, port, out):
    tdist, dist = init_both(rank, world, port)
    import triton

    from chorus.cuda.direct import DirectLaunch
    lines = []

    def row(k, v):
        lines.append(f"{k:50s} {v:8.3f} us")

    t = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
    dist.all_reduce(t)
    C = torch._C
    op = dist.ReduceOp.SUM
    d = {(t.dtype, t.shape, op): 1}
    for name, fn in (("_cuda_getDevice", lambda: C._cuda_getDevice()),
                     ("_cuda_getCurrentRawStream", lambda: C._cuda_getCurrentRawStream(rank)),
                     ("_cuda_isCurrentStreamCapturing", lambda: C._cuda_isCurrentStreamCapturing()),
                     ("t.is_contiguous()", lambda: t.is_contiguous()), ("t.get_device()", lambda: t.get_device()),
                     ("t.data_ptr()", lambda: t.data_ptr()), ("t.shape", lambda: t.shape), ("t.dtype", lambda: t.dtype),
                     ("t.is_cuda", lambda: t.is_cuda), ("dict get (dtype,shape,op)", lambda: d.get((t.dtype, t.shape, op))),
                     ("lambda: None", lambda: None)):
        row(name, cpu(fn, 20000))

    @triton.jit
    def k1(x):
        pass

    @triton.jit
    def k16(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
        pass

    s = torch.cuda.current_stream().cuda_stream
    c1 = k1[(1,)](12345678901)
    args16 = tuple(12345678901 + i for i in range(16))
    c16 = k16[(1,)](*args16)
    torch.cuda.synchronize()
    row("triton k1[(1,)](x)", cpu(lambda: k1[(1,)](12345678901)))
    row("triton k16[(1,)](...)", cpu(lambda: k16[(1,)](*args16)))
    d1, d16 = DirectLaunch.of(c1, 4), DirectLaunch.of(c16, 4)
    if d1 is not None:
        b1, b16 = d1.block((12345678901,)), d16.block(args16)
        row("direct Block k1", cpu(lambda: b1(1, s)))
        row("direct Block k16", cpu(lambda: b16(1, s)))
        row("direct Block k16 grid 8", cpu(lambda: b16(8, s)))
        row("direct Block k16 grid 8 (4 warps) ", cpu(lambda: b16(8, s)))
    # graph launch of the k16 launch
    try:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.graph(g, stream=side):
            k16[(1,)](*args16)
        lib = ctypes.CDLL("libcuda.so.1")
        gl = lib["cuGraphLaunch"]
        gl.restype = ctypes.c_int
        ex = ctypes.c_void_p(g.raw_cuda_graph_exec())
        sv = ctypes.c_void_p(s)
        assert gl(ex, sv) == 0
        row("cuGraphLaunch of a k16 graph", cpu(lambda: gl(ex, sv)))
        g2 = torch.cuda.CUDAGraph()  # (the lane alternates two graphs, one per slot parity)
        with torch.cuda.graph(g2, stream=side):
            k16[(1,)](*args16)
        turn = itertools.cycle([ex, ctypes.c_void_p(g2.raw_cuda_graph_exec())]).__next__
        row("cuGraphLaunch of two k16 graphs, alternating", cpu(lambda: gl(turn(), sv)))
        pydll = ctypes.PyDLL("libcuda.so.1")["cuGraphLaunch"]  # (the GIL kept across the call)
        pydll.restype = ctypes.c_int
        row("cuGraphLaunch, GIL kept (PyDLL)", cpu(lambda: pydll(ex, sv)))
        row("torch graph.replay()", cpu(lambda: g.replay()))
    except Exception as e:
        lines.append(f"graph: {type(e).__name__}: {e}")
    torch.cuda.synchronize()
    tdist.barrier()
    row("chorus.all_reduce 1024 bf16", cpu(lambda: dist.all_reduce(t)))
    o = torch.empty(1024 * world, dtype=torch.bfloat16, device="cuda")
    r = torch.empty(256, dtype=torch.bfloat16, device="cuda")
    row("chorus.all_gather_into_tensor 1024", cpu(lambda: dist.all_gather_into_tensor(o, t), 1000))
    row("chorus.reduce_scatter_tensor 1024", cpu(lambda: dist.reduce_scatter_tensor(r, t), 1000))
    row("torch nccl all_gather_into_tensor 1024", cpu(lambda: tdist.all_gather_into_tensor(o, t), 1000))
    row("chorus.broadcast 1024", cpu(lambda: dist.broadcast(t, 0), 1000))
    for name, fn in (("all_reduce", lambda: dist.all_reduce(t)),
                     ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(o, t)),
                     ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(r, t))):
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(2000):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        sio = io.StringIO()
        pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(30)
        lines.append(f"\n==== cProfile {name} x2000\n" + sio.getvalue())
    with open(os.path.join(out, f"probe-rank{rank}.txt"), "w") as f:
        f.write(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}\n")
        f.write("\n".join(lines) + "\n")
    tdist.barrier()
    torch.cuda.synchronize()
    os._exit(0)


if __name__ == "__main__":
    spawn_per_gpu(body, 29791)
