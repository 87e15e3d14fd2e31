"""The test case of torch's distributed test suite, as each rank imports it.

``tools/torch_suite.py`` runs the tests; this module is what it and the ranks it spawns
import (torch's harness starts every rank with the ``spawn`` start method, which imports
the case's module again in the new process).  Which backend the ranks run on comes from
``CHORUS_TORCH_SUITE_BACKEND``, set by the runner before anything imports torch's suite:

* ``gloo``             -- torch's own gloo, as torch's ``test_distributed_spawn.py`` runs it;
* ``chorus-for-gloo``  -- the suite still asks for gloo (``BACKEND=gloo``, so every test
  that torch runs for gloo runs), and every process group torch would make with gloo
  (the default group, ``new_group()``, ``new_group(backend="gloo")``, ``"cpu:gloo,..."``)
  is made by chorus's backend instead, while ``get_backend()`` still answers "gloo";
* ``chorus``           -- the suite asks for backend "chorus" by name: it then skips every
  test that it keeps for gloo, nccl or ucc (what torch refuses to a backend it does not know).
"""

from __future__ import annotations

import os

MODES = ("gloo", "chorus-for-gloo", "chorus")
MODE = os.environ.get("CHORUS_TORCH_SUITE_BACKEND", "gloo")
if MODE not in MODES:
    raise SystemExit(f"torch_suite_ranks: CHORUS_TORCH_SUITE_BACKEND={MODE!r}; use one of {', '.join(MODES)}")
os.environ["BACKEND"] = "chorus" if MODE == "chorus" else "gloo"
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", "/tmp")  # replaced per test by the suite's own set-up

import torch  # noqa: E402 - after BACKEND is set
import torch.distributed as dist  # noqa: E402
from torch.distributed import distributed_c10d  # noqa: E402
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

if MODE != "gloo":
    import chorus.torch  # noqa: E402, F401 - registers backend "chorus"

if MODE == "chorus":
    DistTestCases.backend_feature["plugin"].add("chorus")  # what the suite asks of an out-of-tree backend

_make_group = distributed_c10d._new_process_group_helper


def _without_gloo(backend) -> str:
    """``backend`` with every "gloo" replaced by "chorus" ("gloo", "cpu:gloo,cuda:nccl")."""
    parts = str(backend).split(",")
    return ",".join(p.rsplit(":", 1)[0] + ":chorus" if p.endswith(":gloo") else
                    "chorus" if p == "gloo" else p for p in parts)


def _chorus_instead_of_gloo(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
    """torch's group constructor, with chorus's backend where torch would make gloo's; the
    group keeps the name it was asked for, so torch routes gloo-only calls
    (``monitored_barrier``, the suite's own ``BACKEND == "gloo"`` branches) to it."""
    replaced = _without_gloo(backend)
    pg, store = _make_group(group_size, group_rank, global_ranks_in_group, replaced, *args, **kwargs)
    if replaced != str(backend) and pg is not None and pg in distributed_c10d._world.pg_map:
        distributed_c10d._world.pg_map[pg] = (backend, store)
    return pg, store


if MODE == "chorus-for-gloo":
    distributed_c10d._new_process_group_helper = _chorus_instead_of_gloo

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

START_METHOD = os.environ.get("CHORUS_TORCH_SUITE_START", "fork")


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """torch's ``test_distributed_spawn.py`` case: each test in fresh ranks, started with
    ``CHORUS_TORCH_SUITE_START`` (``spawn`` as torch's file does; ``fork``, the default,
    skips importing torch again in every rank, most of a test's time under spawn)."""

    def setUp(self):
        super().setUp()
        if START_METHOD == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(torch.multiprocessing.get_context("fork").Process)


assert dist.is_available()
