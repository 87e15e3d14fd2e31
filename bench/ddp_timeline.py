"""Where a DDP step on chorus spends its time: one rank's timeline, step by step.

Trains chorus bench-ddp's MLP (2048-4096-4096-1, batch 8 per rank) with DDP on the
"chorus" backend and records, relative to each step's start: the end of the forward
pass, each bucket's all_reduce as DDP issues it, as chorus's shared-memory op starts and
ends (chorus.shm.collectives.all_reduce, on the group's worker thread), the end of
``loss.backward()`` (DDP has waited for its buckets and copied them out) and the end of
the optimizer step; also when each op's first sync passed (every rank had arrived).
Prints the medians over the timed steps (ms), a column per rank: where the ranks differ
is where a step waits for its slowest rank.

Experiments (environment, set for every rank): ``TIMELINE_WAITS=1`` records how each
shared-memory wait went (yields, sleeps, the longest of each); ``TIMELINE_WORKER_NICE=N``
renices the group's worker thread; ``TIMELINE_SLICE_US=N`` gives chorus's worker and
helper threads an EEVDF slice of N us (sched_setattr, Linux 6.12+);
``TIMELINE_SWITCH_S=S`` sets the interpreter's thread switch interval.

usage: python3 bench/ddp_timeline.py W STEPS [THREADS]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time


def _set_slice(ns: int) -> None:
    """This thread's EEVDF slice (sched_setattr, Linux 6.12+; x86-64 syscall numbers)."""
    import ctypes

    class Attr(ctypes.Structure):
        _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64),
                    ("nice", ctypes.c_int32), ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                    ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64), ("umin", ctypes.c_uint32),
                    ("umax", ctypes.c_uint32)]
    tid = threading.get_native_id()
    attr = Attr(size=ctypes.sizeof(Attr), nice=os.getpriority(os.PRIO_PROCESS, tid), runtime=ns)
    if ctypes.CDLL(None, use_errno=True).syscall(314, tid, ctypes.byref(attr), 0) != 0:
        raise OSError(ctypes.get_errno(), "sched_setattr")


def rank_main(rank: int, world: int, steps: int, threads: int, workdir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import chorus.shm.collectives as shm_collectives
    import chorus.shm.mapped as shm_mapped
    import chorus.torch  # noqa: F401
    from chorus.shm.sync import Sync
    from chorus.torch import backend

    torch.set_num_threads(threads)
    if os.environ.get("TIMELINE_SWITCH_S"):  # experiment: the interpreter's thread switch interval
        sys.setswitchinterval(float(os.environ["TIMELINE_SWITCH_S"]))
    dist.init_process_group("chorus", init_method=f"file://{workdir}/rdzv", rank=rank, world_size=world)
    events: list[tuple[str, float]] = []
    issue, run = backend.ChorusProcessGroup.allreduce, shm_collectives.all_reduce

    def issued(self, tensors, opts=None):
        events.append((f"issue {tensors[0].nbytes >> 20}M", time.perf_counter()))
        return issue(self, tensors, opts)

    slice_us = int(os.environ.get("TIMELINE_SLICE_US", "0"))  # experiment: chorus threads' EEVDF slice
    if slice_us:
        from chorus.shm.crew import Crew
        serve = Crew._serve

        def sliced_serve(*a):
            _set_slice(slice_us * 1000)
            return serve(*a)
        Crew._serve = staticmethod(sliced_serve)

    def running(win, sync, ctx, data, *args, **kwargs):
        nice = os.environ.get("TIMELINE_WORKER_NICE")  # experiment: the worker thread's priority
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), int(nice))
        if slice_us:
            _set_slice(slice_us * 1000)
        running_op[0] = f"{data.nbytes >> 20}M"
        events.append((f"start {running_op[0]}", time.perf_counter()))
        try:
            return run(win, sync, ctx, data, *args, **kwargs)
        finally:
            events.append((f"end {running_op[0]}", time.perf_counter()))
            running_op[0] = ""

    first_sync, on_maps = Sync.sync, shm_mapped.all_reduce
    running_op = [""]  # the size of the op on the worker thread

    waits: list[dict] = []  # per first sync of a step's op: how its wait went (TIMELINE_WAITS=1)
    plain_wait = Sync._wait

    def watched_wait(self, target, ctx):
        """Sync._wait, counting its yields and sleeps and how long they took."""
        clock = time.perf_counter
        begun = clock()
        yields, sleeps = 0, 0
        real_yield, real_sleep = os.sched_yield, time.sleep

        late = [0.0, 0.0]  # the longest yield; the longest a sleep overran its nap (ms)
        waiter = threading.get_ident()

        def counted_yield():
            nonlocal yields
            if threading.get_ident() != waiter:
                return real_yield()
            yields += 1
            t = clock()
            real_yield()
            late[0] = max(late[0], (clock() - t) * 1e3)

        def counted_sleep(s):
            nonlocal sleeps
            if threading.get_ident() != waiter:
                return real_sleep(s)
            sleeps += 1
            t = clock()
            real_sleep(s)
            late[1] = max(late[1], (clock() - t - s) * 1e3)
        # (module-wide for the wait's duration, since Sync._wait calls them through os and
        # time; other threads' calls, e.g. the transport's heartbeat, pass through uncounted)
        os.sched_yield, time.sleep = counted_yield, counted_sleep
        try:
            plain_wait(self, target, ctx)
        finally:
            os.sched_yield, time.sleep = real_yield, real_sleep
        done = clock()
        if running_op[0]:
            waits.append({"op": running_op[0], "ms": (done - begun) * 1e3, "yields": yields, "sleeps": sleeps,
                          "sleep_only": self.sleep_only_until > time.monotonic(),
                          "yield_ms": late[0], "overslept_ms": late[1]})

    if os.environ.get("TIMELINE_WAITS"):
        Sync._wait = watched_wait

    def synced(self, ctx, first=False):
        first_sync(self, ctx, first)
        if first and running_op[0]:
            events.append((f"synced {running_op[0]}", time.perf_counter()))

    def mapped(win, ctx, data, *args, **kwargs):
        events.append((f"mapped {data.nbytes >> 20}M", time.perf_counter()))
        return on_maps(win, ctx, data, *args, **kwargs)

    shm_mapped.all_reduce = mapped

    backend.ChorusProcessGroup.allreduce, shm_collectives.all_reduce = issued, running
    Sync.sync = synced
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                    torch.nn.ReLU(), torch.nn.Linear(4096, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    rows: list[dict[str, float]] = []
    for i in range(steps + 3):
        x, y = torch.randn(8, 2048, generator=data), torch.randn(8, 1, generator=data)
        dist.barrier()
        events.clear()
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        events.append(("forward", time.perf_counter()))
        opt.zero_grad()
        loss.backward()
        events.append(("backward", time.perf_counter()))
        opt.step()
        events.append(("step", time.perf_counter()))
        if i >= 3:
            rows.append({"t0": t0 * 1e3, **{name: (t - t0) * 1e3 for name, t in events}})
    with open(os.path.join(workdir, f"timeline-{rank}.json"), "w") as f:
        json.dump(rows, f)
    if waits:
        with open(os.path.join(workdir, f"waits-{rank}.json"), "w") as f:
            json.dump(waits[-40:], f)
    dist.destroy_process_group()


def report(workdir: str, world: int) -> None:
    """The ranks' median timelines side by side (ms from each step's start), then per step
    the latest rank's arrival at each op and how long the op took after it."""
    steps = []
    for r in range(world):
        with open(os.path.join(workdir, f"timeline-{r}.json")) as f:
            steps.append(json.load(f))
    # CLOCK_MONOTONIC is one clock for every process: measure every rank's events from the
    # first rank's barrier exit of the step (a rank that left the barrier late starts late)
    for i in range(min(len(rows) for rows in steps)):
        start = min(steps[r][i]["t0"] for r in range(world))
        for r in range(world):
            row = steps[r][i]
            late = row.pop("t0") - start
            row.update({name: t + late for name, t in row.items()}, left=late)
    names = list(dict.fromkeys(name for rows in steps for row in rows for name in row))
    ranks = [{name: statistics.median(row[name] for row in rows if name in row)
              for name in names if any(name in row for row in rows)} for rows in steps]
    print(f"{'event':12s}" + "".join(f" {'rank ' + str(r):>8s}" for r in range(world)) + f" {'spread':>8s}")
    for name in ranks[0]:
        cells = [m.get(name) for m in ranks]
        known = [c for c in cells if c is not None]
        print(f"{name:12s}" + "".join(f" {c:8.1f}" if c is not None else f" {'-':>8s}" for c in cells)
              + f" {max(known) - min(known):8.1f}")
    sizes = [name.split()[1] for name in names if name.startswith("start ")]
    print("per op, medians over steps: last rank's start -> every rank's end (ms), steps on registered buffers")
    for size in sizes:
        spans, on_maps = [], 0
        for i in range(min(len(rows) for rows in steps)):
            rows = [steps[r][i] for r in range(world)]
            if all(f"start {size}" in row and f"end {size}" in row for row in rows):
                spans.append(max(row[f"end {size}"] for row in rows) - max(row[f"start {size}"] for row in rows))
                on_maps += all(f"mapped {size}" in row for row in rows)
        if spans:
            print(f"  {size:>5s}: {statistics.median(spans):6.1f} ms after the last start; "
                  f"on registered buffers in {on_maps} of {len(spans)} steps")
    print("per step and op: last start, first and last rank past the first sync, last end (ms)")
    for i in range(min(len(rows) for rows in steps)):
        rows = [steps[r][i] for r in range(world)]
        cells = []
        for size in sizes:
            got = [[row.get(f"{e} {size}") for row in rows] for e in ("start", "synced", "end")]
            if all(t is not None for ts in got for t in ts):
                cells.append(f"{size}: {max(got[0]):6.1f} {min(got[1]):6.1f} {max(got[1]):6.1f} {max(got[2]):6.1f}")
        print(f"  step {i:2d}  " + "   ".join(cells))
    for r in range(world):
        path = os.path.join(workdir, f"waits-{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                waits = json.load(f)
            print(f"rank {r} waits (op: ms, yields, sleeps, longest yield ms, longest oversleep ms): "
                  + " ".join(f"{w['op']}:{w['ms']:.1f},{w['yields']},{w['sleeps']},{w['yield_ms']:.1f},"
                             f"{w['overslept_ms']:.1f}" for w in waits[-10:]))


def main(argv: list[str]) -> int:
    import torch.multiprocessing as mp

    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    world, steps = int(argv[0]), int(argv[1])
    threads = int(argv[2]) if len(argv) == 3 else max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(rank_main, args=(world, steps, threads, workdir), nprocs=world)
        report(workdir, world)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
