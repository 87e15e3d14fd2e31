"""What each GPU process of tests/gpu/test_api_cuda.py runs: the same seeded random program
of collectives and point-to-point on CUDA tensors through ``import chorus as dist``
(backend "nccl", chorus's own CUDA component) and through torch's NCCL, side by side, and
every result compared bit for bit.  Data are small integers, so every reduction is exact
whatever its order."""

from __future__ import annotations

import faulthandler
import os
import random

import torch
import torch.distributed as tdist

import chorus as dist

DTYPES = ["float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"]
INT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
FLOAT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"]
BOOL_OPS = ["SUM", "MIN", "MAX"]


def values(gen: torch.Generator, n: int, dtype: str) -> torch.Tensor:
    """Small integers: -1..2 (0..3 unsigned), or a bool pattern."""
    v = torch.randint(0, 4, (n,), generator=gen)
    if dtype == "bool":
        return (v > 1).cuda()
    if dtype != "uint8":
        v = v - 1
    return v.to(getattr(torch, dtype)).cuda()


def ops_for(dtype: str, world: int) -> list[str]:
    if dtype == "bool":
        return BOOL_OPS
    if dtype.startswith("int") or dtype == "uint8":
        return INT_OPS
    ops = list(FLOAT_OPS)
    if world & (world - 1):  # AVG and a premultiplied sum are exact only when W is a power of two
        ops = [o for o in ops if o not in ("AVG", "PREMUL_SUM")]
    return ops


def red(lib, op: str):
    if op == "PREMUL_SUM":
        return (dist._make_nccl_premul_sum if lib is dist else tdist._make_nccl_premul_sum)(0.5)
    return getattr(lib.ReduceOp, op)


BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}


def nccl_reduce(t: torch.Tensor, op: str, group, root: int | None = None) -> None:
    """torch's NCCL reduction of ``t`` in place (all_reduce, or reduce to ``root``); the
    bitwise ops NCCL lacks are computed from an NCCL all_gather, in rank order."""
    if op not in BITWISE:
        if root is None:
            tdist.all_reduce(t, red(tdist, op), group=group)
        else:
            tdist.reduce(t, dst=root, op=red(tdist, op), group=group)
        return
    parts = [torch.empty_like(t) for _ in range(tdist.get_world_size(group))]
    tdist.all_gather(parts, t, group=group)
    out = parts[0]
    for p in parts[1:]:
        out = BITWISE[op](out, p)
    t.copy_(out)


#: dtypes NCCL does not take: the reference runs on a wider one (exact for these values)
WIDER = {torch.int16: torch.int32}


def nccl(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` for the NCCL side, in a dtype NCCL takes."""
    return t.to(WIDER[t.dtype]) if t.dtype in WIDER else t.clone()


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype:
        b = b.to(a.dtype)
    return a.shape == b.shape and a.dtype == b.dtype and bool((a.view(torch.uint8) == b.view(torch.uint8)).all())


class Program:
    """One random step at a time, run through both libraries on copies of the same data."""

    def __init__(self, rank: int, world: int, seed: int):
        self.rank, self.world = rank, world
        self.rng = random.Random(seed)  # the same choices on every rank
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank)  # this rank's data
        self.groups = [(None, None, list(range(world)))]
        if world >= 3:
            ranks = [0, 2] if world == 3 else [1, 3]
            self.groups.append((dist.new_group(ranks), tdist.new_group(ranks), ranks))
        self.wrong: list[str] = []

    def size(self) -> int:
        return max(1, int(2 ** self.rng.uniform(0, 20)))  # 1 .. 1 Mi elements

    def check(self, what: str, ours, theirs) -> None:
        for a, b in zip(ours, theirs, strict=True):
            if not equal(a, b):
                self.wrong.append(what)
                return

    def step(self, i: int) -> None:
        cg, tg, ranks = self.rng.choice(self.groups)
        dtype = self.rng.choice(DTYPES)
        n = self.size()
        kind = self.rng.choice(["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                                "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                                "all_to_all_single", "p2p_ring", "batch_ring", "barrier"])
        w = len(ranks)
        root_index = self.rng.randrange(w)
        op = self.rng.choice(ops_for(dtype, w))
        counts = [self.rng.randrange(0, 2 * (n // w) + 2) for _ in range(w * w)]  # uneven all_to_all
        if self.rank not in ranks:
            return
        me = ranks.index(self.rank)
        root = ranks[root_index]
        what = f"step {i}: {kind} {dtype} n={n} op={op} root={root} group={ranks}"
        x = values(self.gen, n, dtype)
        c, t = x.clone(), nccl(x)
        if kind == "all_reduce":
            dist.all_reduce(c, red(dist, op), group=cg)
            nccl_reduce(t, op, tg)
            self.check(what, [c], [t])
        elif kind == "broadcast":
            dist.broadcast(c, src=root, group=cg)
            tdist.broadcast(t, src=root, group=tg)
            self.check(what, [c], [t])
        elif kind == "reduce":
            dist.reduce(c, dst=root, op=red(dist, op), group=cg)
            nccl_reduce(t, op, tg, root)
            if self.rank == root:
                self.check(what, [c], [t])
        elif kind == "all_gather":
            co = [torch.empty_like(x) for _ in range(w)]
            to = [torch.empty_like(t) for _ in range(w)]
            dist.all_gather(co, c, group=cg)
            tdist.all_gather(to, t, group=tg)
            self.check(what, co, to)
        elif kind == "all_gather_into_tensor":
            co, to = x.new_empty(w * n), t.new_empty(w * n)
            dist.all_gather_into_tensor(co, c, group=cg)
            tdist.all_gather_into_tensor(to, t, group=tg)
            self.check(what, [co], [to])
        elif kind == "gather":
            co = [torch.empty_like(x) for _ in range(w)] if self.rank == root else None
            to = [torch.empty_like(t) for _ in range(w)] if self.rank == root else None
            dist.gather(c, co, dst=root, group=cg)
            tdist.gather(t, to, dst=root, group=tg)
            if self.rank == root:
                self.check(what, co, to)
        elif kind == "scatter":
            parts = [values(self.gen, n, dtype) for _ in range(w)]
            co, to = torch.empty_like(x), torch.empty_like(t)
            dist.scatter(co, [p.clone() for p in parts] if self.rank == root else None, src=root, group=cg)
            tdist.scatter(to, [nccl(p) for p in parts] if self.rank == root else None, src=root, group=tg)
            self.check(what, [co], [to])
        elif kind in ("reduce_scatter", "reduce_scatter_tensor"):
            if dtype == "bool" or op in BITWISE or op in ("AVG", "PREMUL_SUM") and kind == "reduce_scatter":
                return  # (NCCL's reduce_scatter takes neither bool nor bitwise ops)
            src = values(self.gen, w * n, dtype)
            co, to = x.new_empty(n), t.new_empty(n)
            if kind == "reduce_scatter":
                dist.reduce_scatter(co, list(src.clone().chunk(w)), red(dist, op), group=cg)
                tdist.reduce_scatter(to, list(nccl(src).chunk(w)), red(tdist, op), group=tg)
            else:
                dist.reduce_scatter_tensor(co, src.clone(), red(dist, op), group=cg)
                tdist.reduce_scatter_tensor(to, nccl(src), red(tdist, op), group=tg)
            self.check(what, [co], [to])
        elif kind in ("all_to_all", "all_to_all_single"):
            send = [counts[me * w + j] for j in range(w)]
            recv = [counts[j * w + me] for j in range(w)]
            src = values(self.gen, sum(send), dtype)
            if kind == "all_to_all":
                ins = list(src.split(send))
                co = [x.new_empty(k) for k in recv]
                to = [t.new_empty(k) for k in recv]
                dist.all_to_all(co, [p.clone() for p in ins], group=cg)
                tdist.all_to_all(to, [nccl(p) for p in ins], group=tg)
                self.check(what, co, to)
            else:
                co, to = x.new_empty(sum(recv)), t.new_empty(sum(recv))
                dist.all_to_all_single(co, src.clone(), recv, send, group=cg)
                tdist.all_to_all_single(to, nccl(src), recv, send, group=tg)
                self.check(what, [co], [to])
        elif kind == "p2p_ring" and w > 1:
            nxt, prv = ranks[(me + 1) % w], ranks[(me - 1) % w]
            co, to = torch.empty_like(x), torch.empty_like(t)
            for lib, out, inp, g in ((dist, co, c, cg), (tdist, to, t, tg)):
                if me % 2 == 0:  # even/odd order, as seed 004's ring does
                    lib.send(inp, nxt, group=g)
                    lib.recv(out, prv, group=g)
                else:
                    lib.recv(out, prv, group=g)
                    lib.send(inp, nxt, group=g)
            self.check(what, [co], [to])
        elif kind == "batch_ring" and w > 1:
            nxt, prv = ranks[(me + 1) % w], ranks[(me - 1) % w]
            co, to = torch.empty_like(x), torch.empty_like(t)
            for lib, out, inp, g in ((dist, co, c, cg), (tdist, to, t, tg)):
                ops = [lib.P2POp(lib.isend, inp, nxt, g), lib.P2POp(lib.irecv, out, prv, g)]
                for work in lib.batch_isend_irecv(ops):
                    work.wait()
            self.check(what, [co], [to])
        elif kind == "barrier":
            dist.barrier(group=cg)


def run(rank: int, world: int, port: int, steps: int, seed: int, out: str) -> None:
    # a rank that hangs prints where each of its threads is (into the test's captured output)
    faulthandler.dump_traceback_later(float(os.environ.get("CHORUS_TEST_STACKS_AFTER_S", "75")), exit=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      NCCL_NVLS_ENABLE="0")
    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port + 1}", rank=rank, world_size=world,
                             device_id=torch.device("cuda", rank))
    dist.init_process_group("nccl")  # the seeds' line, with chorus
    prog = Program(rank, world, seed)
    for i in range(steps):
        prog.step(i)
    torch.cuda.synchronize()
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(prog.wrong))
    dist.destroy_process_group()
    tdist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
