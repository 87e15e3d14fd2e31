"""``chorus explain``: every algorithm of the registry (and the shared-memory ones) walked
through step by step, as text and as a page; a traced run replayed."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from chorus.explain.cli import algorithms, main, walkthrough
from chorus.explain.html import render_html
from chorus.explain.replay import replay
from chorus.explain.text import render
from chorus.schedules.registry import ALGORITHMS

EVERY = [(c, a) for c in ALGORITHMS for a in algorithms(c)]


def _final(walk, holder: int, buffer: str) -> list[str]:
    state = walk.steps[-1].state if walk.steps else walk.initial
    return [cell[0] for cell in state[holder][buffer]]


@pytest.mark.parametrize("collective,algorithm", EVERY)
def test_every_algorithm_prints_its_steps_and_writes_a_page(collective, algorithm, tmp_path, capsys):
    page = tmp_path / "page.html"
    assert main([collective, "--world", "4", "--algorithm", algorithm, "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{collective}, algorithm {algorithm}, 4 ranks")
    assert "\nbefore\n" in out and ("\nstep 1 (1/" in out or "\nphase 0" in out or "\nsync (1/" in out)
    assert f"wrote {page}" in out
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and '<svg id="view"' in text and "const WALK = " in text
    assert "<link" not in text and " src=" not in text and "https://" not in text  # self-contained
    data = json.loads(text.split("const WALK = ")[1].split(";\nconst NS")[0])
    assert data["algorithm"] == algorithm and len(data["steps"]) >= 1


@pytest.mark.parametrize("collective,algorithm", EVERY)
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_every_algorithm_ends_with_the_result_on_any_world(collective, algorithm, world):
    root = world - 1
    walk = walkthrough(collective, world, algorithm, root=root)
    sigma = "Σ"
    if collective == "all_reduce":
        assert all(_final(walk, r, "data") == [sigma] * len(_final(walk, r, "data")) for r in range(world))
    elif collective == "reduce":
        assert set(_final(walk, root, "data")) == {sigma}
    elif collective == "reduce_scatter":
        assert all(_final(walk, r, "output") == [sigma] for r in range(world))
    elif collective == "all_gather":
        letters = [chr(97 + r) for r in range(world)]
        assert all(_final(walk, r, "output") == letters for r in range(world))
    elif collective == "all_to_all":
        want = [[f"{chr(97 + q)}{r}" if world > 1 else "a" for q in range(world)] for r in range(world)]
        assert [_final(walk, r, "output") for r in range(world)] == want
    elif collective == "broadcast":
        blocks = [f"{chr(97 + root)}{i}" for i in range(world)] if world > 1 else [chr(97 + root)]
        assert all(_final(walk, r, "data") == blocks for r in range(world))
    elif collective == "barrier" and not algorithm.startswith("shm:") and world > 1:
        assert all(_final(walk, r, "heard") == ["Σ"] for r in range(world))


def test_ring_all_reduce_is_the_docstring_s_ring():
    walk = walkthrough("all_reduce", 4, "ring")
    text = render(walk, doc=False)
    # step 0 of the docstring: 0 -D0->1  1 -A1->2  2 -B2->3  3 -C3->0 (chunk A = data[0])
    assert "  rank 0: data[3]=a -> 1 (4 B)   data[2]+=d <- 3\n" in text
    assert "  rank 2: data[1]=c -> 3 (4 B)   data[0]+=b <- 1\n" in text
    assert len(walk.steps) == 6  # 2 (W - 1)
    after_rs = walk.steps[2].state  # after the reduce-scatter rank r holds chunk r complete
    assert [after_rs[r]["data"][r][0] for r in range(4)] == ["Σ"] * 4
    assert "alpha-beta model" in walk.footer[-1] and "chorus.sim ran the same schedules" in walk.footer[0]


def test_recursive_doubling_bruck_and_the_binomial_tree():
    rd = walkthrough("all_reduce", 4, "recursive_doubling")
    exchanges = [s for s in rd.steps if any(a.kind == "recv" for a in s.actions)]
    assert [[a.peer for a in s.actions if a.kind == "recv" and a.holder == 0] for s in exchanges] == [[1], [2]]
    bruck = walkthrough("all_gather", 5, "bruck")  # the docstring's W = 5 table: rank 0 holds a b, a b c d, all
    held = [[c[0] for c in s.state[0]["output"] if c[0] != "·"] for s in bruck.steps]
    assert held == [["a", "b"], ["a", "b", "c", "d"], ["a", "b", "c", "d", "e"]]
    tree = walkthrough("broadcast", 4, "binomial")
    first = sorted((a.holder, a.peer) for a in tree.steps[0].actions if a.kind == "send")
    assert first == [(0, 2)]
    assert sorted((a.holder, a.peer) for a in tree.steps[1].actions if a.kind == "send") == [(0, 1), (2, 3)]


def test_shared_memory_algorithms_are_phases_with_the_window():
    walk = walkthrough("all_reduce", 4, "shm:one_shot")
    assert walk.holders[-1] == "window" and [s.title.split(":")[0] for s in walk.steps] == ["phase 0", "sync",
                                                                                            "phase 1"]
    assert [c[0] for c in walk.steps[0].state[4]["slot2"]] == ["c"] * 4
    assert "One-shot" in walk.doc or "one-shot" in walk.doc.lower()
    single = walkthrough("all_gather", 3, "shm:single_copy")
    reads = [a for a in single.steps[2].actions if a.holder == 0]
    assert [a.text for a in reads][1] == "rank 0: rank 0's output[1] <- rank 1's input (b)"


def test_bytes_size_the_op_as_nccl_tests_does():
    walk = walkthrough("all_gather", 4, "ring", nbytes=64)  # the whole output: 4 floats per rank
    assert walk.count == 4
    sends = [a for a in walk.steps[0].actions if a.kind == "send"]
    assert {a.nbytes for a in sends} == {16}
    big = walkthrough("all_reduce", 4, None, nbytes=4 << 20)  # followed at 1 element a cell, real bytes
    assert big.algorithm == "rabenseifner" and big.count == 1 << 20  # chorus's choice for 4 MiB
    assert {a.nbytes for a in big.steps[0].actions} == {2 << 20}  # halving: half of the data per message
    assert "followed at 4 element(s) per rank" in big.footer[-2]
    assert walkthrough("all_reduce", 4, "shm:rs_ag", nbytes=4 << 20).steps[0].actions[0].nbytes == 4 << 20
    assert walkthrough("all_reduce", 4, None).algorithm == "recursive_doubling"


def test_bad_arguments_exit_2(capsys):
    assert main(["all_reduce", "--algorithm", "nope"]) == 2
    assert "valid: ring, recursive_doubling" in capsys.readouterr().err
    assert main(["all_reduce", "--world", "100"]) == 2
    assert main(["--list"]) == 0
    assert "all_to_all      pairwise, bruck, linear, shm:window, shm:single_copy" in capsys.readouterr().out


def _trace(tmp_path, groups_per_rank: int) -> str:
    """A merged trace of a 2-rank ring all_reduce of 8 floats: one op span and, per step,
    a send and a receive span per rank (``groups_per_rank`` steps)."""
    events = []
    for r in (0, 1):
        events.append({"ph": "X", "pid": r, "tid": 0, "cat": "op", "name": "all_reduce", "ts": 0.0, "dur": 100.0,
                       "args": {"seq": 3, "component": "tcp", "algorithm": "ring",
                                "call": "all_reduce(float32, count=8, op=SUM)"}})
        for k in range(groups_per_rank):
            for what in ("send", "recv"):
                events.append({"ph": "X", "pid": r, "tid": 0, "cat": "transfer",
                               "name": f"{what} {'->' if what == 'send' else '<-'} {1 - r}", "ts": 10.0 + 40 * k,
                               "dur": 30.0 + r, "args": {"op": "all_reduce", "seq": 3, "bytes": 16, "peer": 1 - r}})
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"world_size": 2}}))
    return str(path)


def test_a_trace_replays_with_measured_times(tmp_path, capsys):
    path = _trace(tmp_path, 2)
    walk, listing = replay(path)
    assert listing == ["group 0 #3 all_reduce(float32, count=8, op=SUM) [tcp/ring]: rank 0 100 us, rank 1 100 us"]
    assert walk.algorithm == "ring" and walk.count == 8 and len(walk.steps) == 2
    assert walk.steps[0].note == "measured: rank 0 30.0 us, rank 1 31.0 us"
    assert walk.footer[:2] == ["replayed from the trace: op #3 of group 0, all_reduce(float32, count=8, op=SUM); "
                               "measured op time rank 0: 100.0 us, rank 1: 100.0 us",
                               "the traced transfers are the schedule's, step by step"]
    assert main(["--trace", path, "--html", str(tmp_path / "t.html")]) == 0
    assert "ops in the trace:" in capsys.readouterr().out
    walk, _ = replay(_trace(tmp_path, 3))
    assert "differ" in walk.footer[1]
    with pytest.raises(ValueError, match="no op #9"):
        replay(path, seq=9)


NODE_DOM = r"""
const fs = require("fs");
const html = fs.readFileSync(process.argv[2], "utf8");
const script = html.split("<script>")[1].split("</script>")[0];
class N { constructor(t) { this.tag = t; this.attrs = {}; this.children = []; this.style = {}; this.textContent = "";
  this.classList = {toggle() {}}; } setAttribute(k, v) { this.attrs[k] = v; } appendChild(c) { this.children.push(c); return c; }
  set innerHTML(v) { this.children = []; } }
const ids = {};
global.document = {createElementNS: (ns, t) => new N(t), getElementById: i => ids[i] || (ids[i] = new N("div")),
                   addEventListener() {}};
global.setInterval = () => 1; global.clearInterval = () => {};
eval(script + ";globalThis.S = show; globalThis.L = arrowLayer; globalThis.K = WALK.steps.length;");
const arrows = [];
for (let k = 0; k <= K; k++) { S(k); arrows.push(L.children.length / 2); }
console.log(JSON.stringify({arrows, title: ids.title.textContent, actions: ids.actions.textContent.split("\n").length}));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the page's script is not run")
def test_the_page_script_runs_every_step(tmp_path):
    page = tmp_path / "ring.html"
    page.write_text(render_html(walkthrough("all_reduce", 4, "ring")))
    script = tmp_path / "dom.js"
    script.write_text(NODE_DOM)
    run = subprocess.run(["node", str(script), str(page)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["arrows"] == [0] + [4] * 6  # before; then each step: every rank hears from its left neighbour
    assert out["title"] == "step 6 (6/6)" and out["actions"] == 8
