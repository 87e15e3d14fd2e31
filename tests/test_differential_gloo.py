"""Differential tests: the same inputs through chorus and through torch's gloo give the
same outputs (identical for integers, allclose for floats), for every collective x reduce
op x dtype family x (the world of 4 ranks, a sub-group of 3).

One gloo job computes torch's outputs; chorus then runs the same cases on each of its
components, checking that its world group really runs there: real processes over TCP
(``CHORUS_TRANSPORT=tcp``), over shared memory (the default on one host), on two
simulated hosts of two ranks (``CHORUS_HOST_ID``: hierarchical), and ranks as threads
(loopback, with and without shared-memory windows, and on simulated hosts).  The
process jobs are forks of a server that imported torch once (proc_support.run_forked).
"""

import pytest

torch = pytest.importorskip("torch")

from differential_cases import as_numpy, cases, members, run_case, same  # noqa: E402
from grid_cases import component  # noqa: E402
from proc_support import run_forked  # noqa: E402

import chorus  # noqa: E402
from chorus.testing import run_threads  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

WORLD = 4
HOSTS = "a,a,b,b"
COMPONENTS = {  # name: (environment, kind, what the world group must run on)
    "tcp": ({"CHORUS_TRANSPORT": "tcp"}, "processes", "p2p"),
    "shm": ({}, "processes", "shm"),
    "hierarchical": ({"CHORUS_HOST_ID": HOSTS}, "processes", "hierarchical"),
    "threads-loopback": ({"CHORUS_TRANSPORT": "tcp"}, "threads", "p2p"),
    "threads-shm": ({}, "threads", "shm"),
    "threads-hierarchical": ({"CHORUS_HOST_ID": HOSTS}, "threads", "hierarchical"),
}


def _gloo_rank(rank, world, workdir):
    """Every case on torch's gloo: (outputs, cases gloo refused with why)."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"file://{workdir}/gloo", rank=rank, world_size=world)
    groups = {sub: tdist.new_group(members(world, sub)) for sub in (False, True)}
    outputs, refused = {}, {}
    for case in cases():
        try:
            outputs[case] = as_numpy(run_case(tdist, case, rank, world, groups[case[3]]))
        except (RuntimeError, ValueError, TypeError) as exc:
            refused[case] = str(exc).splitlines()[0][:120]
    tdist.destroy_process_group()
    return outputs, refused


def _chorus_cases(rank, world, ordered):
    groups = {sub: chorus.new_group(members(world, sub)) for sub in (False, True)}
    return component(chorus.group.WORLD), {case: as_numpy(run_case(chorus, case, rank, world, groups[case[3]]))
                                           for case in ordered}


def _chorus_rank(rank, world, workdir, ordered):
    chorus.init_process_group("chorus", init_method=f"file://{workdir}/chorus", rank=rank, world_size=world)
    try:
        return _chorus_cases(rank, world, ordered)
    finally:
        chorus.destroy_process_group()


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    """(the cases gloo ran on every rank, in order; each rank's outputs)."""
    results = run_forked(_gloo_rank, WORLD, str(tmp_path_factory.mktemp("gloo")))
    ran = set.intersection(*(set(outputs) for outputs, _ in results))
    assert len(ran) >= 150, f"only {len(ran)} cases ran on gloo: {list(results[0][1].items())[:5]}"
    return [case for case in cases() if case in ran], [outputs for outputs, _ in results]


@pytest.mark.parametrize("name", COMPONENTS)
def test_chorus_matches_gloo(name, gloo, tmp_path, monkeypatch):
    env, kind, expected_component = COMPONENTS[name]
    for var in ("CHORUS_TRANSPORT", "CHORUS_HOST_ID"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    ordered, theirs = gloo
    if kind == "processes":
        results = run_forked(_chorus_rank, WORLD, str(tmp_path), ordered)
    else:
        results = run_threads(_chorus_cases, WORLD, ordered)
    assert [where for where, _ in results] == [expected_component] * WORLD
    differ = [(rank, case) for rank, (_, mine) in enumerate(results) for case in ordered
              if not same(mine[case], theirs[rank][case], case[1])]
    assert not differ, f"chorus ({name}) differs from gloo in {len(differ)} cases, e.g. {differ[:5]}"
