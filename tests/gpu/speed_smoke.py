"""A quick correctness check of chorus.cuda's fused all_reduce paths against NCCL, one
process per GPU: every algorithm (auto, one_shot, two_shot, two_shot_push, copy_reduce up to 1 MiB),
bfloat16 and float32, sizes 8 B .. 64 MiB (x4) plus odd counts, through the public API,
the component's lane (all_reduce_now) and async_op; integer-valued data, so the results
must equal NCCL's bit for bit.  Prints one compact line per (dtype, algorithm) and a
verdict; exits 1 on any wrong element or error.

    python tests/gpu/speed_smoke.py [--world 4] [--max 64M]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ports import free_port  # noqa: E402


def _data(torch, n, dtype, rank, salt):
    v = (torch.arange(n, device="cuda", dtype=torch.int64) * 7 + rank * 3 + salt) % 4 - 1
    return v.to(dtype)


def rank_main(rank, world, ports, max_bytes, queue, time_limit):
    import faulthandler

    import torch
    import torch.distributed as tdist

    import chorus
    from chorus.api.state import current
    from chorus.components.select import device_component

    # a rank still running near the time limit prints where each of its threads is
    faulthandler.dump_traceback_later(max(1.0, time_limit - 5), exit=False)
    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world,
                             device_id=torch.device("cuda", rank))
    chorus.init_process_group("chorus", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=world,
                              timeout=30)
    print(f"rank {rank}: both groups made", file=sys.stderr, flush=True)
    results = []
    sizes = []
    b = 8
    while b <= max_bytes:
        sizes.append(b)
        b *= 4
    for dtype in (torch.bfloat16, torch.float32):
        item = dtype.itemsize
        counts = sorted({max(1, s // item) for s in sizes} | {1, 3, 1001, 65537, 1000003})
        for algo in ("auto", "one_shot", "two_shot", "two_shot_push", "copy_reduce", "lane", "async"):
            wrong = checked = 0
            error = ""
            t0 = time.perf_counter()
            for salt, n in enumerate(counts):
                if algo == "copy_reduce" and n * item > 1 << 20:
                    continue
                try:
                    x = _data(torch, n, dtype, rank, salt)
                    want = x.clone()
                    tdist.all_reduce(want)
                    if algo == "lane":
                        comp = device_component(current().default_group, "cuda")
                        if not comp.all_reduce_now(x, chorus.ReduceOp.SUM):
                            chorus.all_reduce(x)
                    elif algo == "async":
                        chorus.all_reduce(x, async_op=True).wait()
                    else:
                        chorus.all_reduce(x, algorithm=None if algo == "auto" else algo)
                    torch.cuda.synchronize()
                    wrong += int((x.view(-1).view(torch.uint8).view(n, item)
                                  != want.view(-1).view(torch.uint8).view(n, item)).any(dim=1).sum().item())
                    checked += 1
                except Exception as exc:  # noqa: BLE001 - reported, and this algorithm stops
                    error = f"n={n}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    traceback.print_exc()
                    break
            results.append((str(dtype)[6:], algo, checked, wrong, error, time.perf_counter() - t0))
            # as it goes (stderr): a run killed at its time limit still shows how far each rank got
            print(f"rank {rank}: {str(dtype)[6:]} {algo}: {checked} sizes, {wrong} wrong, "
                  f"{time.perf_counter() - t0:.1f} s{' ' + error if error else ''}", file=sys.stderr, flush=True)
            if error:
                break
        if any(r[4] for r in results):
            break
    # MAX and AVG once, two sizes
    try:
        for op in (chorus.ReduceOp.MAX, chorus.ReduceOp.AVG):
            for n in (1000, 1 << 20):
                x = _data(torch, n, torch.float32, rank, 5) * 4
                want = x.clone()
                tdist.all_reduce(want, op=getattr(tdist.ReduceOp, op.name))
                chorus.all_reduce(x, op=op)
                torch.cuda.synchronize()
                results.append(("float32", op.name, 1, int((x != want).sum().item()), "", 0.0))
    except Exception as exc:  # noqa: BLE001
        results.append(("float32", "MAX/AVG", 0, 0, f"{type(exc).__name__}: {exc}", 0.0))
    queue.put((rank, results))
    torch.cuda.synchronize()
    tdist.barrier()
    chorus.destroy_process_group()
    tdist.destroy_process_group()


def main() -> int:
    import torch
    import torch.multiprocessing as mp

    from chorus.bench.sizes import parse_size

    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--max", default="64M")
    p.add_argument("--time-limit", type=float, default=120.0)
    a = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if a.world < 2:
        print(f"SMOKE FAIL: needs 2 or more GPUs, found {torch.cuda.device_count()}")
        return 1
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    first = free_port(pair=True)  # (outside the ephemeral range: tests/gpu/ports.py)
    ports = (first, first + 1)  # one pair for every rank: they rendezvous there
    procs = [ctx.Process(target=rank_main, args=(r, a.world, ports, parse_size(a.max), queue, a.time_limit))
             for r in range(a.world)]
    for proc in procs:
        proc.start()
    got = {}
    deadline = time.monotonic() + a.time_limit
    try:
        while len(got) < a.world and time.monotonic() < deadline:
            try:
                rank, results = queue.get(timeout=1.0)
                got[rank] = results
            except Exception:  # noqa: BLE001 - queue.Empty
                if not any(proc.is_alive() for proc in procs) and queue.empty():
                    break
        for proc in procs:
            proc.join(max(0.0, min(20.0, deadline - time.monotonic())))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    ok = len(got) == a.world
    print(f"{'dtype':>9} {'algorithm':>12} {'sizes':>6} {'#wrong':>7} {'rank-0 s':>8}  error")
    merged: dict = {}
    for rank, results in sorted(got.items()):
        for dtype, algo, checked, wrong, error, secs in results:
            m = merged.setdefault((dtype, algo), [checked, 0, "", secs])
            m[1] += wrong
            m[2] = m[2] or (f"rank {rank}: {error}" if error else "")
    for (dtype, algo), (checked, wrong, error, secs) in merged.items():
        ok = ok and not wrong and not error and checked > 0
        print(f"{dtype:>9} {algo:>12} {checked:>6} {wrong:>7} {secs:>8.2f}  {error}")
    if len(got) < a.world:
        print(f"only {len(got)} of {a.world} ranks reported (killed after {a.time_limit:g} s or crashed)")
    print("SMOKE", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
