"""The seeds' examples (examples/seeds/) print what the seeds say they print -- and the
same lines as the unchanged torch.distributed script on torch's gloo backend.

The torch variant of every example is generated from the chorus script by swapping its
import lines (``import chorus as dist`` -> ``import torch.distributed as dist``,
``import chorus as mp`` -> ``import torch.multiprocessing as mp``), so the two never
drift apart.  Lines are compared as multisets: the ranks' lines interleave differently
on every run.

How the examples run
--------------------
Each example needs 4 ranks that import torch, and ``import torch`` costs about 3 s of
CPU here; started the way a user starts them (``python script.py`` whose ``mp.spawn``
starts fresh interpreters, or ``python -m chorus.run``), the ~30 runs would take
several minutes on 2 cores.  So by default every run is a fork of one server process
that imported torch and chorus once (multiprocessing's forkserver): the script runs as
``__main__``, its ``mp.spawn`` / ``chorus.spawn`` start their ranks with fork instead of
fresh interpreters, and launcher-style scripts get torchrun's environment variables
(MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE) -- real processes and real TCP,
only the interpreter start-up is shared.  ``test_a_launcher_example_as_users_run_it``
runs one example exactly as a user does; ``CHORUS_SEEDS_REAL=1`` runs every example that
way, a spawn-style one too (``test_a_spawn_example_as_users_run_it``; by default
tests/test_spawn.py runs a spawn-style script as users do, without torch).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import re
import runpy
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from proc_support import reserved_port, torch_forkserver

from chorus.launch.supervisor import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "seeds"
REAL = os.environ.get("CHORUS_SEEDS_REAL") == "1"
TIMEOUT_S = 180
WORLD = 4
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
               "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


@dataclass(frozen=True)
class Example:
    """One example script and what its run must print.

    ``how``: "spawn" (the script starts its 4 ranks itself), "launcher" (4 ranks started
    by chorusrun/torchrun), "single" (one process).  ``expected``: every line, in any
    order (or None and ``check`` decides).  ``no_torch``: why there is no torch
    comparison; ``torch_ignores``: lines left out of the comparison, and why.
    """

    script: str
    how: str
    expected: tuple[str, ...] | None = None
    check: Callable[[list[str]], None] | None = None
    env: dict[str, str] = field(default_factory=dict)
    no_torch: str = ""
    torch_ignores: tuple[str, str] | None = None  # (regex, reason)
    name: str = ""

    @property
    def id(self) -> str:
        return self.name or self.script.removesuffix(".py")


def _ranks(fmt: str, **per_rank) -> tuple[str, ...]:
    """One line per rank: ``fmt`` formatted with r and each keyword's r-th value."""
    return tuple(fmt.format(r=r, **{k: v[r] for k, v in per_rank.items()}) for r in range(WORLD))


def _check_training(world: int) -> Callable[[list[str]], None]:
    """helpers_training.py: the ranks agree on everything (its numbers depend on the seed)."""

    def check(lines: list[str]) -> None:
        seeds = [ln for ln in lines if ln.startswith("All processes using seed: ")]
        assert len(seeds) == world and len(set(seeds)) == 1, seeds
        norms = [ln for ln in lines if re.fullmatch(r"GPU \d gradient norm: \d+\.\d{4}", ln)]
        assert len(norms) == world, lines
        evals = Counter(re.sub(r"^Rank \d: ", "", ln) for ln in lines if ", eval loss " in ln)
        assert evals and set(evals.values()) == {world}, evals  # every rank got rank 0's numbers
        last_accuracy = sorted(evals)[-1].rsplit(" ", 1)[1]
        counted = {ln.rsplit(" ", 1)[1] for ln in lines if "accuracy from summed counts" in ln}
        assert counted == {last_accuracy}, (counted, last_accuracy)
        assert float(last_accuracy) >= 0.8
        assert "parameters identical on all ranks: True" in lines
        assert "Checkpoint saved" in lines
        assert sum(ln.endswith("checkpoint save confirmed, matches my parameters: True") for ln in lines) == world
        assert len([ln for ln in lines if ln.startswith("Epoch ")]) >= 1

    return check


_HELPERS = "chorus.utils is the seed's distributed.py module; torch has no counterpart to swap in"

SEED_EXAMPLES = [
    Example("p2p_sync.py", "spawn", _ranks("Rank {r} has data tensor({v}.)", v=[0, 1, 0, 0])),
    Example("p2p_async.py", "spawn", _ranks("Rank {r} has data tensor({v}.)", v=[9, 0, 45, 0])),
    Example("broadcast.py", "spawn",
            _ranks("Rank {r} has data ['foo', 12, {{1: 2}}]")
            + _ranks("Rank {r} has data tensor([100., 100.])") * 2
            + _ranks("Rank {r} has data tensor([{v}., {v}.])", v=[2, 2, 4, 6])),
    Example("reduce.py", "spawn",
            _ranks("Rank {r} all_reduce SUM: tensor([12.])") + _ranks("Rank {r} all_reduce MAX: tensor([6.])")
            + _ranks("Rank {r} reduce to rank 0: tensor([{v}.])", v=[12, 2, 4, 6])
            + _ranks("Rank {r} has data tensor([12., 12.])"),
            torch_ignores=(r"Rank [1-9] reduce to rank 0:",
                           "torch gloo uses the tensors of ranks other than dst as scratch space; torch "
                           "documents only dst's result (chorus leaves the others unchanged)")),
    Example("gather.py", "spawn",
            _ranks("Rank {r} all_gather: [tensor([1, 2]), tensor([3, 4]), tensor([5, 6]), tensor([7, 8])]")
            + _ranks("Rank {r} all_gather_into_tensor: tensor([1, 2, 3, 4, 5, 6, 7, 8])")
            + _ranks("rank:{r} ['foo', 12, {{1: 2}}, 'xiaodongguaAIGC']")
            + _ranks("rank:{r} all-gather result tensor([1, 2, 3, 4, 5, 6, 7, 8])")),
    Example("reduce_scatter.py", "spawn",
            _ranks("Rank {r} reduce_scatter: tensor([{a}, {b}])", a=["0", " 8", "16", "24"], b=[4, 12, 20, 28])
            + _ranks("Rank {r} reduce_scatter (stack): tensor([[{a}, {b}]])", a=["0", " 8", "16", "24"], b=[4, 12, 20, 28])
            + _ranks("Rank {r} p2p reduce_scatter: tensor([{a}, {b}])", a=["0", " 8", "16", "24"], b=[4, 12, 20, 28])),
    Example("ring_allreduce.py", "spawn",
            ("Stage 1 (ReduceScatter) complete", "Stage 2 (AllGather) complete")
            + _ranks("Rank {r} after ReduceScatter: [{v}]", v=[
                ", ".join(f"tensor([{c}, {c}])" for c in chunks)
                for chunks in ([1, 4, 3, 2], [2, 1, 4, 3], [3, 2, 1, 4], [4, 3, 2, 1])])
            + _ranks("Rank {r} after AllGather: [tensor([4, 4]), tensor([4, 4]), tensor([4, 4]), tensor([4, 4])]")),
    Example("all_to_all.py", "spawn", (
        "Rank 0 input: tensor([0, 1, 2, 3]) → output: tensor([ 0,  4,  8, 12])",
        "Rank 1 input: tensor([4, 5, 6, 7]) → output: tensor([ 1,  5,  9, 13])",
        "Rank 2 input: tensor([ 8,  9, 10, 11]) → output: tensor([ 2,  6, 10, 14])",
        "Rank 3 input: tensor([12, 13, 14, 15]) → output: tensor([ 3,  7, 11, 15])",
        "Rank 0 output: [tensor([0]), tensor([4]), tensor([8]), tensor([12])]",
        "Rank 1 output: [tensor([1]), tensor([5]), tensor([9]), tensor([13])]",
        "Rank 2 output: [tensor([2]), tensor([6]), tensor([10]), tensor([14])]",
        "Rank 3 output: [tensor([3]), tensor([7]), tensor([11]), tensor([15])]",
        "Rank 0 variable output: tensor([ 0,  1, 10, 11, 12, 20, 21, 30, 31])",
        "Rank 1 variable output: tensor([ 2,  3, 13, 14, 22, 32, 33])",
        "Rank 2 variable output: tensor([ 4, 15, 16, 23, 34, 35])",
        "Rank 3 variable output: tensor([ 5, 17, 18, 24, 36])")),
    Example("spawn_all_reduce.py", "spawn",
            ("world_size = 4",) + _ranks("rank {r}: after all_reduce, x = 6.0")),
    Example("basic_collectives.py", "spawn",
            _ranks("Rank {r} has tensor: 1.0") + _ranks("Rank {r} has tensor after all_reduce: 6.0")),
    Example("init_methods.py", "single",
            ("torch distributed is available: True", "gloo available: True", "nccl available: False",
             "is_initialized: True", "is_initialized: True", "backend: gloo", "rank: 0", "world_size: 1"),
            env={"RANK": "0", "WORLD_SIZE": "1"}),
    Example("torchrun_all_reduce.py", "launcher",
            ("world_size = 4",) + _ranks("rank {r}: after all_reduce, x = 6.0")),
    Example("subgroups.py", "launcher",
            _ranks("rank {r}: all_reduce in its group = {v}", v=[1.0, 1.0, 5.0, 5.0])),
    Example("torchrun_env.py", "launcher", ("world_size: 4",) + _ranks("LOCAL_RANK: {r}"),
            no_torch="it imports no distributed module: there is nothing to swap"),
    Example("helpers_debug.py", "launcher",
            _ranks("Rank {r}: reduce test 6.0 == 6") + ("Gathered: [0.0, 1.0, 2.0, 3.0]",)
            + _ranks("Rank {r}: broadcast result tensor([1., 2., 3.])")
            + _ranks("Rank {r}: async all_reduce [10.0, 10.0, 10.0, 10.0]"), no_torch=_HELPERS),
    Example("helpers_debug.py", "single",
            ("Rank 0: reduce test 0.0 == 0", "Gathered: [0.0]", "Rank 0: broadcast result tensor([1., 2., 3.])"),
            no_torch=_HELPERS, name="helpers_debug_alone"),
    Example("helpers_training.py", "launcher", check=_check_training(WORLD), no_torch=_HELPERS),
    Example("helpers_training.py", "single", check=_check_training(1), no_torch=_HELPERS,
            name="helpers_training_alone"),
]


# -- running a script ---------------------------------------------------------------------------
def torch_variant(source: str) -> str:
    """The same script on torch.distributed: only the import lines change."""
    out, n = re.subn(r"^import chorus as dist\b.*$", "import torch.distributed as dist", source, flags=re.M)
    assert n == 1, "an example must import chorus as dist exactly once"
    return re.sub(r"^import chorus as mp\b.*$", "import torch.multiprocessing as mp", out, flags=re.M)


def script_for(ex: Example, variant: str, tmp: Path) -> Path:
    path = EXAMPLES / ex.script
    if variant == "chorus":
        return path
    copy = tmp / f"torch_{ex.script}"
    copy.write_text(torch_variant(path.read_text()))
    return copy


def base_env(ex: Example, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k != "PYTHONUNBUFFERED"}
    env.update(SEED_PAUSE="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.update(ex.env)
    return env


def rank_env(env: dict[str, str], rank: int) -> dict[str, str]:
    """torchrun's variables for ``rank`` of a one-node job of WORLD processes."""
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
            "LOCAL_WORLD_SIZE": str(WORLD), "GROUP_RANK": "0"}


def run_real(ex: Example, variant: str, tmp: Path) -> tuple[int, str, str]:
    """As a user runs it: ``python script.py``, or 4 ranks under chorusrun (chorus) or
    with torchrun's variables set by hand (torch: chorusrun holds MASTER_PORT, which
    torch's own env:// rendezvous would have to bind)."""
    with reserved_port() as port:
        return _run_real(ex, variant, tmp, port)


def _run_real(ex: Example, variant: str, tmp: Path, port: int) -> tuple[int, str, str]:
    script, env = script_for(ex, variant, tmp), base_env(ex, port)
    if ex.how != "launcher":
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                           timeout=TIMEOUT_S, cwd=ROOT)
        return p.returncode, p.stdout, p.stderr
    if variant == "chorus":
        p = subprocess.run([sys.executable, "-m", "chorus.run", "--nproc-per-node", str(WORLD),
                            "--master-port", "0", str(script)], capture_output=True, text=True, env=env,
                           timeout=TIMEOUT_S, cwd=ROOT)
        return p.returncode, re.sub(r"(?m)^\[rank\d+\]:", "", p.stdout), p.stderr
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=rank_env(env, r), cwd=ROOT) for r in range(WORLD)]
    outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    return (max(abs(p.returncode) for p in procs), "".join(o for o, _ in outs), "".join(e for _, e in outs))


def _forked_script(script: str, how: str, env: dict[str, str], out: str, err: str) -> None:
    """In a fork of the forkserver: run ``script`` as __main__ with whole-line output
    to ``out``/``err``; the ranks it spawns are forks too."""
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(f, fd)
        os.close(f)
    # line-buffered: each print reaches the file in one write, so ranks never split lines
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    fork = multiprocessing.get_context("fork")
    multiprocessing.get_context = lambda method=None: fork  # mp.spawn / chorus.spawn fork
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script]
    if how != "launcher":
        runpy.run_path(script, run_name="__main__")
        return
    ranks = [fork.Process(target=_forked_rank, args=(script, rank_env(env, r), os.getpid())) for r in range(WORLD)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(TIMEOUT_S)
    codes = [p.exitcode for p in ranks]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


def _forked_rank(script: str, env: dict[str, str], launcher_pid: int) -> None:
    die_with_parent(launcher_pid)  # a killed (timed-out) run leaves no rank behind
    os.environ.clear()
    os.environ.update(env)
    runpy.run_path(script, run_name="__main__")


def run_forked(ex: Example, variant: str, tmp: Path) -> tuple[int, str, str]:
    ctx = torch_forkserver()  # shared with the other torch tests: torch is imported once
    out, err = tmp / f"{variant}-{ex.id}.out", tmp / f"{variant}-{ex.id}.err"
    with reserved_port() as port:
        p = ctx.Process(target=_forked_script,
                        args=(str(script_for(ex, variant, tmp)), ex.how, base_env(ex, port), str(out), str(err)))
        p.start()
        p.join(TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()
    return p.exitcode, _read(out), _read(err)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


_OUTPUTS: dict[tuple[str, str], list[str]] = {}


def output_of(ex: Example, variant: str) -> list[str]:
    """The lines the example prints (run once per variant and cached)."""
    key = (ex.id, variant)
    if key not in _OUTPUTS:
        if "import torch" in (EXAMPLES / ex.script).read_text():
            pytest.importorskip("torch")
        with tempfile.TemporaryDirectory(prefix="chorus-seeds-") as tmp:
            code, out, err = (run_real if REAL else run_forked)(ex, variant, Path(tmp))
        assert code == 0, f"{ex.script} ({variant}) failed with {code}:\n{out}\n{err[-4000:]}"
        _OUTPUTS[key] = out.splitlines()
    return _OUTPUTS[key]


def check_lines(ex: Example, lines: list[str]) -> None:
    if ex.check is not None:
        ex.check(lines)
    if ex.expected is not None:
        assert Counter(lines) == Counter(ex.expected), "\n".join(sorted(lines))


# -- the tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("ex", SEED_EXAMPLES, ids=lambda ex: ex.id)
def test_example_prints_what_the_seed_says(ex):
    check_lines(ex, output_of(ex, "chorus"))


@pytest.mark.parametrize("ex", SEED_EXAMPLES, ids=lambda ex: ex.id)
def test_example_prints_the_same_lines_as_torch_gloo(ex):
    if ex.no_torch:
        pytest.skip(f"no torch variant: {ex.no_torch}")
    pytest.importorskip("torch")
    ours, theirs = output_of(ex, "chorus"), output_of(ex, "torch")
    if ex.torch_ignores is not None:
        pattern = re.compile(ex.torch_ignores[0])  # reason: ex.torch_ignores[1]
        ours, theirs = ([ln for ln in lines if not pattern.match(ln)] for lines in (ours, theirs))
    assert sorted(ours) == sorted(theirs)


def _example(name: str) -> Example:
    return next(ex for ex in SEED_EXAMPLES if ex.id == name)


@pytest.mark.skipif(not REAL, reason="its 5 fresh interpreters import torch (~15 s of CPU); CHORUS_SEEDS_REAL=1 "
                                     "runs it (a spawn-style script run so without torch: tests/test_spawn.py)")
def test_a_spawn_example_as_users_run_it(tmp_path):
    """``python examples/seeds/p2p_sync.py``: mp.spawn-style, ranks in fresh interpreters."""
    pytest.importorskip("torch")
    ex = _example("p2p_sync")
    code, out, err = run_real(ex, "chorus", tmp_path)
    assert code == 0, err
    check_lines(ex, out.splitlines())


def test_a_launcher_example_as_users_run_it(tmp_path):
    """``python -m chorus.run --nproc-per-node 4 examples/seeds/torchrun_env.py``."""
    ex = _example("torchrun_env")
    code, out, err = run_real(ex, "chorus", tmp_path)
    assert code == 0, err
    check_lines(ex, out.splitlines())


def test_every_seed_example_is_tested():
    scripts = {p.name for p in EXAMPLES.glob("*.py")}
    assert scripts == {ex.script for ex in SEED_EXAMPLES}


def test_torch_variant_swaps_only_the_imports():
    src = "import os\nimport chorus as dist  # torch: ...\nimport chorus as mp  # torch: ...\nx = dist.get_rank()\n"
    assert torch_variant(src) == ("import os\nimport torch.distributed as dist\nimport torch.multiprocessing as mp\n"
                                  "x = dist.get_rank()\n")
