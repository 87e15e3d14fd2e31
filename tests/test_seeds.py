"""The seeds' examples (examples/seeds/): the tutorials' code as the seeds write it, with
``import chorus as dist`` for ``import torch.distributed as dist`` (examples/seeds/README.md
lists every other change).  Each must print what the seed says it prints -- the values an
NCCL (or gloo) run of the seed prints -- and the same lines as the same code on torch.

Variants
--------
"chorus" is the file as it is.  "torch" is a copy of examples/seeds/ in which every
``import chorus as dist`` is swapped back to ``import torch.distributed as dist``
(distributed.py, the helpers module, included), so the two never drift apart.  This
machine has no GPU: both run through the examples' ``_cpu_fallback`` (``"cuda"`` means the
CPU, ``torch.cuda.set_device`` does nothing, and torch.distributed's ``"nccl"`` becomes
``"gloo"``), so the torch variant is torch's gloo.  On GPUs, examples/seeds/run_on_gpus.sh
makes the same comparison against NCCL.  Lines are compared as multisets: the ranks'
lines interleave differently on every run.

Ports
-----
The seeds hard-code their ports (12801, 29500, 29501).  So that test runs on one machine
never meet there, every ``tcp://`` init_method is redirected, at the call, to a port
reserved for the run (in both variants; the example's text is untouched), and env://
examples get that port as MASTER_PORT.

How the examples run
--------------------
Each example has 4 ranks that import torch, and ``import torch`` costs about 3 s of CPU
here; started the way a user starts them (``python script.py`` whose ``mp.spawn`` starts
fresh interpreters, or a launcher), the ~30 runs would take minutes on 2 cores.  So by
default every run is a fork of one server process that imported torch and chorus once
(multiprocessing's forkserver): the script runs as ``__main__`` (its folder first on
sys.path, a scratch folder as working directory), ``mp.spawn`` starts its ranks with fork
instead of fresh interpreters, and launcher-style scripts get torchrun's environment
variables (MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE) -- real processes and
real TCP, only the interpreter start-up is shared.  ``test_*_as_users_run_it`` run one
example of each kind exactly as a user does; ``CHORUS_SEEDS_REAL=1`` runs every example
that way.
"""

from __future__ import annotations

import io
import math
import multiprocessing
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from proc_support import reserved_port

from chorus.launch.supervisor import die_with_parent

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "seeds"
HELPER_MODULES = {"_cpu_fallback.py", "distributed.py"}  # imported by examples, not run
SEEDS_DIR = Path(os.environ.get("CHORUS_SEEDS_DIR", "/work/shared/seeds"))  # the tutorials, if here
REAL = os.environ.get("CHORUS_SEEDS_REAL") == "1"
TIMEOUT_S = 180
WORLD = 4
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
               "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
S0, S1, S2, S3, S4 = ("000_8bfd9a46bf105215.txt", "001_5fc9b1909656c151.txt", "002_ae7205c92d7eeded.txt",
                      "003_c0b9def01b497aca.txt", "004_2a19141315c547ad.txt")


@dataclass(frozen=True)
class Example:
    """One example script, the seed it comes from, and what its run must print.

    ``how``: "spawn" (the script starts its 4 ranks itself), "launcher" (4 ranks started
    by a launcher, as torchrun does), "single" (one process).  ``expected``: every line,
    in any order (or None and ``check`` decides).  ``no_torch``: why there is no torch
    comparison; ``torch_ignores``: lines left out of the comparison, and why.
    """

    script: str
    seed: str
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
    """helpers_training.py: its numbers depend on the data, but the ranks agree on everything."""

    def check(lines: list[str]) -> None:
        seeds = [ln for ln in lines if ln.startswith("All processes using seed: ")]
        assert len(seeds) == world and len(set(seeds)) == 1, seeds
        epochs = [ln for ln in lines if re.fullmatch(r"Epoch \d, Eval loss: \d\.\d+", ln)]
        assert [ln.split(",")[0] for ln in epochs] == ["Epoch 0", "Epoch 1", "Epoch 2"], lines
        losses = [float(ln.rsplit(" ", 1)[1]) for ln in epochs]
        assert losses[-1] < losses[0] < math.log(2), losses  # it learns
        rates = Counter(re.sub(r"^Rank \d: ", "", ln) for ln in lines if ": learning rate " in ln)
        assert rates == {"learning rate 0.05000000074505806": world}, rates  # 0.5 * 0.1 in float32
        assert Counter(ln for ln in lines if "early stop" in ln) == Counter(
            f"Rank {r}: early stop: False" for r in range(world))
        assert lines.count("Checkpoint saved") == 1
        assert lines.count("All processes: checkpoint save confirmed") == world
        assert len(lines) == 4 * world + 4, lines

    return check


SEED_EXAMPLES = [
    Example("p2p_sync.py", S4, "spawn", _ranks("Rank {r} has data tensor({v}.)", v=[0, 1, 0, 0])),
    Example("p2p_async.py", S4, "spawn", _ranks("Rank {r} has data tensor({v}.)", v=[9, 0, 45, 0])),
    Example("broadcast.py", S4, "spawn",
            _ranks("Rank {r} has data ['foo', 12, {{1: 2}}]")
            + _ranks("Rank {r} has data tensor([100., 100.])") * 2
            + _ranks("Rank {r} has data tensor([{v}., {v}.])", v=[2, 2, 4, 6])),
    Example("reduce.py", S4, "spawn",
            _ranks("Rank {r} all_reduce SUM: tensor([12.])") + _ranks("Rank {r} all_reduce MAX: tensor([6.])")
            + _ranks("Rank {r} reduce to rank 0: tensor([{v}.])", v=[12, 2, 4, 6])
            + _ranks("Rank {r} has data tensor([12., 12.])"),
            torch_ignores=(r"Rank [1-9] reduce to rank 0:",
                           "torch gloo uses the tensors of ranks other than dst as scratch space; torch "
                           "documents only dst's result (chorus, like NCCL, leaves the others unchanged)")),
    Example("gather.py", S4, "spawn",
            _ranks("Rank {r} all_gather: [tensor([1, 2]), tensor([3, 4]), tensor([5, 6]), tensor([7, 8])]")
            + _ranks("Rank {r} all_gather_into_tensor: tensor([1, 2, 3, 4, 5, 6, 7, 8])")
            + _ranks("rank:{r} ['foo', 12, {{1: 2}}, 'xiaodongguaAIGC']")
            + _ranks("rank:{r} all-gather result tensor([1, 2, 3, 4, 5, 6, 7, 8])")),
    Example("reduce_scatter.py", S4, "spawn",
            _ranks("Rank {r} reduce_scatter: tensor([{a}, {b}])", a=["0", " 8", "16", "24"], b=[4, 12, 20, 28])
            + _ranks("Rank {r} reduce_scatter (stack): tensor([[{a}, {b}]])", a=["0", " 8", "16", "24"], b=[4, 12, 20, 28])
            + _ranks("Rank {r} p2p reduce_scatter: tensor([{a}, {b}])", a=["0", " 8", "16", "24"], b=[4, 12, 20, 28])),
    Example("ring_allreduce.py", S4, "spawn",
            ("Stage 1 (ReduceScatter) complete", "Stage 2 (AllGather) complete")
            + _ranks("Rank {r} after ReduceScatter: [{v}]", v=[
                ", ".join(f"tensor([{c}, {c}])" for c in chunks)
                for chunks in ([1, 4, 3, 2], [2, 1, 4, 3], [3, 2, 1, 4], [4, 3, 2, 1])])
            + _ranks("Rank {r} after AllGather: [tensor([4, 4]), tensor([4, 4]), tensor([4, 4]), tensor([4, 4])]")),
    Example("all_to_all.py", S4, "spawn", (  # the seed launches run_single and run_variable_size
        "Rank 0 input: tensor([0, 1, 2, 3]) → output: tensor([ 0,  4,  8, 12])",
        "Rank 1 input: tensor([4, 5, 6, 7]) → output: tensor([ 1,  5,  9, 13])",
        "Rank 2 input: tensor([ 8,  9, 10, 11]) → output: tensor([ 2,  6, 10, 14])",
        "Rank 3 input: tensor([12, 13, 14, 15]) → output: tensor([ 3,  7, 11, 15])",
        "Rank 0 variable output: tensor([ 0,  1, 10, 11, 12, 20, 21, 30, 31])",
        "Rank 1 variable output: tensor([ 2,  3, 13, 14, 22, 32, 33])",
        "Rank 2 variable output: tensor([ 4, 15, 16, 23, 34, 35])",
        "Rank 3 variable output: tensor([ 5, 17, 18, 24, 36])")),
    Example("spawn_all_reduce.py", S2, "spawn",
            ("world_size = 4",) + _ranks("rank {r}: after all_reduce, x = 6.0")),
    Example("basic_collectives.py", S1, "spawn",
            _ranks("Rank {r} has tensor: 1.0") + _ranks("Rank {r} has tensor after all_reduce: 6.0")),
    Example("init_methods.py", S4, "single",
            ("torch distributed is available: True", "gloo available: True", "nccl available: False",
             "is_initialized: True", "is_initialized: True", "backend: gloo", "rank: 0", "world_size: 1"),
            env={"RANK": "0", "WORLD_SIZE": "1"}),
    Example("torchrun_all_reduce.py", S2, "launcher",
            ("world_size = 4",) + _ranks("rank {r}: after all_reduce, x = 6.0")),
    Example("subgroups.py", S0, "launcher",  # only group1 ([0, 1]) all-reduces: ranks 2 and 3 keep theirs
            _ranks("rank {r}: tensor = {v}", v=[1.0, 1.0, 2.0, 3.0])),
    Example("torchrun_env.py", S4, "launcher", ("world_size: 4",) + _ranks("LOCAL_RANK: {r}"),
            no_torch="it imports no distributed module: there is nothing to swap"),
    Example("helpers_debug.py", S3, "launcher",
            _ranks("Rank {r}: reduce test 6.0 == 6") + ("Gathered: [0.0, 1.0, 2.0, 3.0]",)
            + _ranks("Rank {r}: broadcast result tensor([1., 2., 3.])")
            + _ranks("Rank {r}: async all_reduce [10.0, 10.0, 10.0, 10.0]")),
    Example("helpers_debug.py", S3, "single",
            ("Rank 0: reduce test 0.0 == 0", "Gathered: [0.0]", "Rank 0: broadcast result tensor([1., 2., 3.])"),
            name="helpers_debug_alone"),
    Example("helpers_training.py", S3, "launcher", check=_check_training(WORLD)),
    Example("helpers_training.py", S3, "single", check=_check_training(1), name="helpers_training_alone"),
]


# -- the torch variant and the port redirection ---------------------------------------------
_CHORUS_IMPORT = re.compile(r"^import chorus as dist\b.*$", re.M)


def torch_variant(source: str) -> str:
    """The same file on torch.distributed: only the import line changes."""
    return _CHORUS_IMPORT.sub("import torch.distributed as dist", source)


def variant_dir(variant: str, tmp: Path) -> Path:
    """examples/seeds itself, or a copy of its modules with the imports swapped back."""
    if variant == "chorus":
        return EXAMPLES
    folder = tmp / "torch"
    folder.mkdir(exist_ok=True)
    for path in EXAMPLES.glob("*.py"):
        text = torch_variant(path.read_text())
        assert not re.search(r"^\s*(import|from)\s+chorus\b", text, re.M), path  # nothing of chorus left
        (folder / path.name).write_text(text)
    return folder


#: Run in every process of a test run (forked: before the script; real: as sitecustomize):
#: a ``tcp://`` init_method goes to the run's reserved port instead of the seed's.
_REDIRECT = '''
import functools, os, re


def _redirected(init_process_group, port):
    @functools.wraps(init_process_group)
    def wrapper(*args, **kwargs):
        args = list(args)
        if len(args) > 1:
            kwargs["init_method"] = args.pop(1)
        method = kwargs.get("init_method")
        if isinstance(method, str) and method.startswith("tcp://"):
            kwargs["init_method"] = re.sub(r":\\d+(?=$|[/?])", ":" + port, method, count=1)
        return init_process_group(*args, **kwargs)
    return wrapper


if os.environ.get("CHORUS_SEEDS_TCP_PORT"):
    import importlib
    _module = importlib.import_module(os.environ["CHORUS_SEEDS_DIST"])  # chorus or torch.distributed
    _module.init_process_group = _redirected(_module.init_process_group, os.environ["CHORUS_SEEDS_TCP_PORT"])
'''


def base_env(ex: Example, variant: str, port: int, extra_path: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and k != "PYTHONUNBUFFERED"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CHORUS_SEEDS_TCP_PORT=str(port),
               CHORUS_SEEDS_DIST="chorus" if variant == "chorus" else "torch.distributed",
               PYTHONPATH=os.pathsep.join(filter(None, [extra_path, str(ROOT), os.environ.get("PYTHONPATH")])))
    env.update(ex.env)
    return env


def rank_env(env: dict[str, str], rank: int) -> dict[str, str]:
    """torchrun's variables for ``rank`` of a one-node job of WORLD processes."""
    return {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
            "LOCAL_WORLD_SIZE": str(WORLD), "GROUP_RANK": "0"}


# -- running a script ---------------------------------------------------------------------------
def run_real(ex: Example, variant: str, tmp: Path) -> tuple[int, str, str]:
    """As a user runs it: ``python script.py``, or 4 ranks under chorusrun (chorus) or
    with torchrun's variables set by hand (torch: chorusrun holds MASTER_PORT, which
    torch's own env:// rendezvous would have to bind)."""
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_REDIRECT)
    work = tmp / "work"
    work.mkdir()
    with reserved_port() as port:
        script, env = variant_dir(variant, tmp) / ex.script, base_env(ex, variant, port, str(site))
        if ex.how != "launcher":
            p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                               timeout=TIMEOUT_S, cwd=work)
            return p.returncode, p.stdout, p.stderr
        if variant == "chorus":
            p = subprocess.run([sys.executable, "-m", "chorus.run", "--nproc-per-node", str(WORLD),
                                "--master-port", "0", str(script)], capture_output=True, text=True, env=env,
                               timeout=TIMEOUT_S, cwd=work)
            return p.returncode, re.sub(r"(?m)^\[rank\d+\]:", "", p.stdout), p.stderr
        procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=rank_env(env, r), cwd=work) for r in range(WORLD)]
        outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
        return max(abs(p.returncode) for p in procs), "".join(o for o, _ in outs), "".join(e for _, e in outs)


_PRELOAD = ["numpy", "torch", "torch.distributed", "torch.multiprocessing", "torch.nn.functional", "torch.optim",
            "torch._dynamo", "chorus",
            "chorus.api.collectives", "chorus.api.exchange", "chorus.api.gathering", "chorus.api.objects",
            "chorus.api.p2p", "chorus.launch", "chorus.rendezvous", "chorus.store", "chorus.transport.tcp",
            "chorus.utils"]


def _forked_script(script: str, how: str, env: dict[str, str], work: str, out: str, err: str) -> None:
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
    exec(_REDIRECT, {"__name__": "seeds_redirect"})
    _skip_pauses_of(script)
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` does
    os.chdir(work)
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


def _skip_pauses_of(script: str) -> None:
    """The seeds pause a second here and there (``time.sleep(1)``) so that a reader sees
    the ranks print in turn; the lines are compared whatever their order, so a pause the
    example itself calls returns at once (chorus's own sleeps still sleep; the run "as
    users run it" keeps every pause)."""
    real = time.sleep

    def sleep(seconds: float) -> None:
        if sys._getframe(1).f_code.co_filename != script:
            real(seconds)

    time.sleep = sleep


def _forked_rank(script: str, env: dict[str, str], launcher_pid: int) -> None:
    die_with_parent(launcher_pid)  # a killed (timed-out) run leaves no rank behind
    os.environ.clear()
    os.environ.update(env)
    runpy.run_path(script, run_name="__main__")


def run_forked(ex: Example, variant: str, tmp: Path) -> tuple[int, str, str]:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD + [__name__])
    out, err, work = tmp / f"{variant}-{ex.id}.out", tmp / f"{variant}-{ex.id}.err", tmp / "work"
    work.mkdir()
    with reserved_port() as port:
        script = variant_dir(variant, tmp) / ex.script
        p = ctx.Process(target=_forked_script,
                        args=(str(script), ex.how, base_env(ex, variant, port), str(work), str(out), str(err)))
        p.start()
        p.join(TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()
    return p.exitcode, _read(out), _read(err)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


_OUTPUTS: dict[tuple[str, str], list[str]] = {}
GLOO_SETUP_FAILED = "Gloo connectFullMesh failed"


def output_of(ex: Example, variant: str) -> list[str]:
    """The lines the example prints (run once per variant and cached)."""
    key = (ex.id, variant)
    if key not in _OUTPUTS:
        if "import torch" in (EXAMPLES / ex.script).read_text():
            pytest.importorskip("torch")
        for attempt in (1, 2):
            with tempfile.TemporaryDirectory(prefix="chorus-seeds-") as tmp:
                code, out, err = (run_real if REAL else run_forked)(ex, variant, Path(tmp))
            # torch's gloo fails its own mesh set-up now and then under the parallel suite
            # ("connectFullMesh failed ... Connection closed by peer"): that is the reference
            # run's set-up, not what these tests check, so the torch run gets one more go
            if code == 0 or variant != "torch" or GLOO_SETUP_FAILED not in err or attempt == 2:
                break
        assert code == 0, f"{ex.script} ({variant}) failed with {code}:\n{out}\n{err[-4000:]}"
        _OUTPUTS[key] = out.splitlines()
    return _OUTPUTS[key]


def check_lines(ex: Example, lines: list[str]) -> None:
    if ex.check is not None:
        ex.check(lines)
    if ex.expected is not None:
        assert Counter(lines) == Counter(ex.expected), "\n".join(sorted(lines))


def _comparable(ex: Example, lines: list[str]) -> list[str]:
    """Lines for the torch comparison: without ``torch_ignores``, numbers with more than 4
    decimals rounded to 4 significant digits (sums in another order may differ in the
    last bits: helpers_training prints losses after averaged float32 gradients)."""
    if ex.torch_ignores is not None:
        pattern = re.compile(ex.torch_ignores[0])  # reason: ex.torch_ignores[1]
        lines = [ln for ln in lines if not pattern.match(ln)]
    return sorted(re.sub(r"\d+\.\d{5,}", lambda m: f"{float(m[0]):.4g}", ln) for ln in lines)


# -- the tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("ex", SEED_EXAMPLES, ids=lambda ex: ex.id)
def test_example_prints_what_the_seed_says(ex):
    check_lines(ex, output_of(ex, "chorus"))


@pytest.mark.parametrize("ex", SEED_EXAMPLES, ids=lambda ex: ex.id)
def test_example_prints_the_same_lines_as_torch(ex):
    if ex.no_torch:
        pytest.skip(f"no torch variant: {ex.no_torch}")
    pytest.importorskip("torch")
    assert _comparable(ex, output_of(ex, "chorus")) == _comparable(ex, output_of(ex, "torch"))


def _example(name: str) -> Example:
    return next(ex for ex in SEED_EXAMPLES if ex.id == name)


@pytest.mark.slow
def test_the_ring_runs_with_rendezvous_sends(tmp_path, monkeypatch):
    """With CHORUS_SEND_MODE=rendezvous every send waits for its receive, as torch's do: the
    ring's order (rank 0 sends first, the others receive first) still runs as the seed says."""
    pytest.importorskip("torch")
    monkeypatch.setenv("CHORUS_SEND_MODE", "rendezvous")
    ex = _example("ring_allreduce")
    code, out, err = run_forked(ex, "chorus", tmp_path)
    assert code == 0, err
    check_lines(ex, out.splitlines())


def test_a_spawn_example_as_users_run_it(tmp_path):
    """``python examples/seeds/spawn_all_reduce.py``: the seed's own torch mp.spawn with the
    "spawn" start method, ranks in fresh interpreters that import _cpu_fallback too."""
    pytest.importorskip("torch")
    ex = _example("spawn_all_reduce")
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
    scripts = {p.name for p in EXAMPLES.glob("*.py")} - HELPER_MODULES
    assert scripts == {ex.script for ex in SEED_EXAMPLES}


def test_every_example_is_in_the_readme_table():
    readme = (EXAMPLES / "README.md").read_text()
    for name in {p.name for p in EXAMPLES.glob("*.py")}:
        assert f"`{name}`" in readme, name


def test_torch_variant_swaps_only_the_import():
    src = "import os\nimport chorus as dist  # seed: ...\nimport torch.multiprocessing as mp\nx = dist.get_rank()\n"
    assert torch_variant(src) == ("import os\nimport torch.distributed as dist\nimport torch.multiprocessing as mp\n"
                                  "x = dist.get_rank()\n")


def _is_addition(line: str) -> bool:
    return any(mark in line for mark in ("# seed:", "not in the seed", "# changed", "# ---- seed:"))


@pytest.mark.skipif(not SEEDS_DIR.is_dir(), reason=f"the seeds are not at {SEEDS_DIR} (CHORUS_SEEDS_DIR)")
@pytest.mark.parametrize("ex", {ex.script: ex for ex in SEED_EXAMPLES}.values(), ids=lambda ex: ex.id)
def test_example_lines_are_the_seeds(ex):
    """Every line of an example is a line of its seed (indentation aside), except the lines
    marked as not the seed's: inside a ``# ---- not in the seed`` section (up to the next
    ``# ---- seed:`` marker), or carrying ``# seed:`` (the swapped import), ``not in the
    seed`` or ``# changed``.  Helpers in distributed.py are checked with helpers_*."""
    seed_lines = {ln.strip() for ln in (SEEDS_DIR / ex.seed).read_text().splitlines()}
    files = [ex.script] + (["distributed.py"] if ex.script.startswith("helpers_") else [])
    for name in files:
        ours, section_added = [], False
        for line in (EXAMPLES / name).read_text().splitlines():
            if line.strip().startswith("# ---- "):
                section_added = "not in the seed" in line
            if line.strip() and not section_added and not _is_addition(line):
                ours.append(line.strip())
        missing = [ln for ln in ours if ln not in seed_lines]
        assert not missing, f"{name}: lines not in {ex.seed}: {missing}"


_FALLBACK_CHECK = """
import importlib
import sys
import torch
# with a GPU (pretended), importing the module must change nothing
available = torch.cuda.is_available
torch.cuda.is_available = lambda: True
set_device, init = torch.cuda.set_device, torch.distributed.init_process_group
import _cpu_fallback
assert torch.cuda.set_device is set_device and torch.distributed.init_process_group is init
print("untouched")
if available():
    raise SystemExit  # a real GPU: there is no CPU case to check
# without one: the same module, imported afresh, makes the seeds' CUDA lines CPU ones
torch.cuda.is_available = available
del sys.modules["_cpu_fallback"]
importlib.import_module("_cpu_fallback")
torch.cuda.set_device(3)
tensors = [torch.tensor([1], device="cuda"), torch.zeros(2, device="cuda:1"), torch.ones(1).cuda(),
           torch.ones(1).to("cuda"), torch.ones(1).to(0), torch.ones(1).to(device=torch.device("cuda", 2)),
           next(torch.nn.Linear(2, 1).to(1).parameters()), torch.randn(2, device=torch.device("cuda"))]
assert all(t.device.type == "cpu" for t in tensors), [t.device for t in tensors]
assert torch.ones(2, dtype=torch.int64).to(torch.float32).dtype == torch.float32  # other .to()s as they were
store = torch.distributed.HashStore()
torch.distributed.init_process_group(backend="nccl", store=store, rank=0, world_size=1)
print(torch.distributed.get_backend())
torch.distributed.destroy_process_group()
"""


def test_cpu_fallback_changes_cuda_to_cpu_without_a_gpu_and_nothing_with_one():
    """Without a GPU, _cpu_fallback makes the seeds' CUDA lines CPU ones (and torch's nccl
    gloo); with one, it changes nothing.  One interpreter checks both (torch's import is
    the cost): first with a GPU pretended, then, on a machine without one, the module
    imported again."""
    torch = pytest.importorskip("torch")
    p = subprocess.run([sys.executable, "-c", _FALLBACK_CHECK], capture_output=True, text=True,
                       cwd=EXAMPLES, timeout=TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(EXAMPLES)})
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == (["untouched"] if torch.cuda.is_available() else ["untouched", "gloo"])


def test_chorus_never_imports_the_fallback():
    for path in (ROOT / "chorus").rglob("*.py"):
        assert "_cpu_fallback" not in path.read_text(), path
