"""The collective grid: every collective (tests/grid_cases.py: each dtype, each reduce op
valid for it, every root, the world and a sub-group, sync and async, small and large)
on every component -- ranks as threads over the loopback transport (point-to-point
schedules, shared-memory windows, simulated hosts) with 1-4 ranks, real processes over
TCP (4 ranks), over shared memory (2 and 4), on simulated hosts (hierarchical, 4).

One job per (component, world size) runs the whole grid inside its ranks (a process
job costs one start-up, not one per case: its ranks are forks of a server that imported
chorus once, proc_support.run_forked); each rank returns its mismatches against numpy,
and the tests below read them per collective.  The components are chosen with
the public switches: ``CHORUS_TRANSPORT=tcp`` (no shared memory), the default (shared
memory on one host), ``CHORUS_HOST_ID`` (ranks on simulated hosts); each job checks
that its world group runs where it should.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading

import grid_cases
import pytest
from grid_cases import COLLECTIVES, cases
from proc_support import leftovers, run_forked

import chorus
from chorus.testing import run_threads


@dataclasses.dataclass(frozen=True)
class Component:
    """A way to run a job: ``kind`` threads or processes, the environment that picks the
    component, and what the world group must then report (grid_cases.component)."""

    kind: str
    world: int
    env: tuple[tuple[str, str], ...]
    component: str
    transport: str

    @property
    def large(self) -> bool:
        """Whether the job runs the LARGE cases: processes do; threads (the same code but the
        transport) only with 3 ranks, where no block divides evenly."""
        return self.kind == "processes" or self.world == 3

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.component}-{self.world}"


def _hosts(world: int) -> str:
    """Two simulated hosts: the first ranks on a, the rest on b (a,a,b / a,a,b,b)."""
    return ",".join("a" if r < (world + 1) // 2 else "b" for r in range(world))


TCP, SHM = (("CHORUS_TRANSPORT", "tcp"),), ()
COMPONENTS = (
    [Component("threads", w, TCP, "p2p", "LoopbackTransport") for w in (1, 2, 3, 4)]
    + [Component("threads", w, SHM, "shm", "LoopbackTransport") for w in (1, 2, 3, 4)]
    + [Component("threads", w, (("CHORUS_HOST_ID", _hosts(w)),), "hierarchical", "LoopbackTransport")
       for w in (3, 4)]
    + [Component("processes", 4, TCP, "p2p", "TcpTransport")]
    + [Component("processes", w, SHM, "shm", "TcpTransport") for w in (2, 4)]
    + [Component("processes", 4, (("CHORUS_HOST_ID", _hosts(4)),), "hierarchical", "TcpTransport")]
)


@pytest.fixture(scope="module", ids=lambda c: c.id,
                params=[pytest.param(c, marks=[pytest.mark.slow] if c.kind == "processes" else [])
                        for c in COMPONENTS])
def grid(request, tmp_path_factory):
    """(component, each rank's grid_cases.Report) of one job running the whole grid."""
    comp = request.param
    workdir = str(tmp_path_factory.mktemp(comp.id))
    job = "grid" + secrets.token_hex(6)  # shared-memory names of its own (other runs share /dev/shm)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("CHORUS_TRANSPORT", "CHORUS_HOST_ID"):
            mp.delenv(name, raising=False)
        for name, value in comp.env:
            mp.setenv(name, value)
        mp.setenv("CHORUS_JOB_ID", job)
        if comp.kind == "threads":
            reports = run_threads(grid_cases.run_grid, comp.world, workdir, comp.large, timeout=100, op_timeout=20)
        else:
            reports = run_forked(_process_grid, comp.world, workdir, comp.large)
    assert not leftovers(job), "a thread job left shared-memory files behind"  # (run_forked checks its own)
    return comp, reports


def _process_grid(rank, world, workdir, large):
    chorus.init_process_group("chorus", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world,
                              timeout=20)
    try:
        return grid_cases.run_grid(rank, world, workdir, large)
    finally:
        chorus.destroy_process_group()


def test_the_job_ran_on_its_component(grid):
    comp, reports = grid
    assert [(r.rank, r.component, r.transport) for r in reports] == \
        [(rank, comp.component, comp.transport) for rank in range(comp.world)]


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_collective(grid, collective):
    comp, reports = grid
    expected_cases = sum(case.collective == collective for case in cases(comp.world, comp.large))
    for report in reports:
        wrong = [(case, why) for case, why in report.wrong if case.split(" ", 1)[0] == collective]
        others = [(case, why) for case, why in report.wrong if case.split(" ", 1)[0] != collective]
        assert not wrong, f"rank {report.rank}: {len(wrong)} wrong, e.g. {wrong[:4]}"
        assert report.ran[collective] == expected_cases, \
            f"rank {report.rank} ran {report.ran[collective]} of {expected_cases} cases (stopped at {others[-1:]})"


def test_the_grid_covers_every_dtype_op_root_and_form():
    """What the cases are, for a world of 4 (a grid that skipped some could not fail)."""
    grid4 = cases(4)
    ops = {(c.dtype, c.op) for c in grid4 if c.collective == "all_reduce" and not c.sub}
    assert ops == {(d, op) for d in grid_cases.DTYPES for op in grid_cases.ops_for(d)}
    for coll in grid_cases.ROOTED:
        assert {c.root for c in grid4 if c.collective == coll and not c.sub} == {0, 1, 2, 3}
        assert {c.root for c in grid4 if c.collective == coll and c.sub} == {0, 1, 2}
    for coll in grid_cases.REDUCING:
        assert {(c.dtype, c.op) for c in grid4 if c.collective == coll and not c.sub} == ops
    for coll in COLLECTIVES:
        forms = {(c.sub, c.async_op, c.n == grid_cases.LARGE) for c in grid4 if c.collective == coll}
        assert forms >= {(False, False, False), (True, False, False), (False, True, False)}, coll
        assert coll == "barrier" or (False, False, True) in forms, coll
    assert {c.variant for c in grid4 if c.collective == "all_to_all_single"} == {"even", "uneven"}


@pytest.mark.parametrize("collective,wrong", [
    ("all_gather", lambda outs, t, **kw: [o.fill(1) for o in outs] and None),
    ("reduce", lambda t, dst, **kw: None),  # the root keeps its own input
    ("scatter", lambda t, parts, src, **kw: t.fill(0) if parts is None else t.__setitem__(..., parts[-1])),
    ("barrier", lambda **kw: None),  # nobody waits
])
def test_the_grid_sees_a_wrong_result(collective, wrong, monkeypatch, tmp_path):
    """A collective that gives wrong results (a stand-in for chorus's) fails the grid.  For
    the barrier, rank 0 starts only once rank 1 has finished: a barrier that waits would
    hang here, one that does not lets rank 1 past before rank 0 arrived."""
    monkeypatch.setattr(chorus, collective, wrong)
    rank1_done = threading.Event()

    def only(rank, world, workdir):
        if rank == 0 and collective == "barrier":
            assert rank1_done.wait(30)
        report = grid_cases.run_grid(rank, world, workdir, False, only=collective)
        if rank == 1:
            rank1_done.set()
        return report

    reports = run_threads(only, 3, str(tmp_path))
    assert all(r.ran[collective] for r in reports)
    assert any(r.wrong for r in reports)
