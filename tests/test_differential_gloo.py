"""Differential tests: the same inputs through chorus and torch's gloo give the same
outputs (identical for integers, allclose for floats), for every collective x reduce op x
dtype family x world size x (world group, a sub-group); chorus runs both over TCP in real
processes and as threads over the loopback transport."""

import os
import pickle
import tempfile

import pytest

torch = pytest.importorskip("torch")

from differential_cases import as_numpy, cases, members, run_case, same  # noqa: E402

import chorus  # noqa: E402
from chorus.launch import spawn  # noqa: E402
from chorus.testing import run_threads  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _worker(rank, world, workdir):
    import torch.distributed as tdist

    chorus.init_process_group("chorus", init_method=f"file://{workdir}/chorus", rank=rank, world_size=world)
    tdist.init_process_group("gloo", init_method=f"file://{workdir}/gloo", rank=rank, world_size=world)
    groups = {sub: (chorus.new_group(members(world, sub)), tdist.new_group(members(world, sub)))
              for sub in (False, True)}
    report = {"gloo_unsupported": [], "differ": [], "gloo": {}}
    for case in cases():
        cg, tg = groups[case[3]]
        try:
            theirs = as_numpy(run_case(tdist, case, rank, world, tg))
        except (RuntimeError, ValueError, TypeError) as exc:
            report["gloo_unsupported"].append((case, str(exc).splitlines()[0][:120]))
            continue
        mine = as_numpy(run_case(chorus, case, rank, world, cg))
        report["gloo"][case] = theirs
        if not same(mine, theirs, case[1]):
            report["differ"].append((case, mine, theirs))
    with open(os.path.join(workdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(report, f)
    tdist.destroy_process_group()
    chorus.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_chorus_matches_gloo(world):
    with tempfile.TemporaryDirectory() as workdir:
        spawn(_worker, args=(world, workdir), nprocs=world)
        reports = []
        for rank in range(world):
            with open(os.path.join(workdir, f"rank{rank}.pkl"), "rb") as f:
                reports.append(pickle.load(f))
    differ = [(rank, d[0]) for rank, r in enumerate(reports) for d in r["differ"]]
    assert not differ, f"chorus (TCP) differs from gloo in {len(differ)} cases, e.g. {differ[:5]}"
    ran = set.intersection(*(set(r["gloo"]) for r in reports))  # gloo ran them on every rank
    assert len(ran) >= 60, f"only {len(ran)} cases ran on gloo: {reports[0]['gloo_unsupported'][:5]}"
    ordered = [case for case in cases() if case in ran]

    def thread_body(rank, w):
        groups = {sub: chorus.new_group(members(w, sub)) for sub in (False, True)}
        return {case: as_numpy(run_case(chorus, case, rank, w, groups[case[3]])) for case in ordered}

    threaded = run_threads(thread_body, world)
    bad = [(rank, case) for rank in range(world) for case in ordered
           if not same(threaded[rank][case], reports[rank]["gloo"][case], case[1])]
    assert not bad, f"chorus (threads) differs from gloo in {len(bad)} cases, e.g. {bad[:5]}"
