"""Run a function on W ranks, for tests: as threads over the loopback transport
(milliseconds to start) or as real processes over TCP.

    def body(rank, world_size):
        t = np.full(4, rank)
        dist.all_reduce(t)
        return t

    results = run_threads(body, 4)      # [array, array, array, array]
"""

from __future__ import annotations

import os
import pickle
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

from chorus.api.init import destroy_process_group, init_process_group, install, is_initialized
from chorus.api.state import World, use_world
from chorus.errors import ChorusError
from chorus.launch import spawn
from chorus.transport.loopback import LoopbackFabric


class RankFailed(ChorusError):
    """A rank of a test job raised; ``errors`` maps rank -> exception."""

    def __init__(self, errors: dict[int, BaseException]):
        first = min(errors)
        tb = "".join(traceback.format_exception(errors[first]))
        super().__init__(f"ranks {sorted(errors)} failed; rank {first}:\n{tb}")
        self.errors = errors


def run_threads(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                op_timeout: float = 30.0, backend: str = "chorus", return_exceptions: bool = False,
                fabric: LoopbackFabric | None = None) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` threads, each an initialized rank.

    Returns the per-rank results.  If a rank raises, raises RankFailed (or, with
    ``return_exceptions``, puts the exception in that rank's slot).  A rank still running
    after ``timeout`` seconds raises TimeoutError naming it.
    """
    fabric = fabric or LoopbackFabric(world_size)
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}
    transports = [fabric.transport(rank) for rank in range(world_size)]  # all exist before any sends

    def body(rank: int) -> None:
        world = World()
        use_world(world)
        try:
            install(world, transports[rank], backend, op_timeout)
            results[rank] = fn(rank, world_size, *args)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            errors[rank] = exc
        finally:
            if world.default_group is not None:
                destroy_process_group()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise TimeoutError(f"run_threads: ranks {stuck} still running after {timeout} s (a hang?)")
    if errors and not return_exceptions:
        raise RankFailed(errors)
    for rank, exc in errors.items():
        results[rank] = exc
    return results


def _process_main(rank: int, fn, world_size: int, init_file: str, out_dir: str, args: tuple, op_timeout: float):
    init_process_group("chorus", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                       timeout=op_timeout)
    try:
        result = fn(rank, world_size, *args)
    finally:
        if is_initialized():
            destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_processes(fn: Callable[..., Any], world_size: int, *args: Any, op_timeout: float = 60.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` real processes over TCP.

    ``fn`` must be importable (defined at module level).  Returns the per-rank results
    (pickled back); a failing rank raises chorus.launch's ProcessRaisedException.
    """
    with tempfile.TemporaryDirectory(prefix="chorus-test-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        spawn(_process_main, args=(fn, world_size, init_file, tmp, args, op_timeout), nprocs=world_size)
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
