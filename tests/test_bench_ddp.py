"""``chorus bench-ddp``: the summary and table from per-rank results, argument errors, and
one real run (a tiny MLP, 2 ranks) that must show every variant and equal losses."""

from __future__ import annotations

import json

import pytest
from proc_support import run_forked

pytest.importorskip("torch", reason="chorus bench-ddp needs torch (pip install 'chorus[torch]')")

from chorus.bench import ddp  # noqa: E402


def _rank(times: dict, cpu: float = 0.01, losses=(1.0, 0.5)) -> dict:
    return {"times": times, "cpu": {k: [cpu] * len(v) for k, v in times.items()},
            "losses": {"ddp chorus": list(losses), "ddp gloo": list(losses)}, "buckets": [4096]}


def test_summary_takes_the_slowest_rank_per_step_and_ratios_of_medians():
    r0 = _rank({"ddp gloo": [0.010, 0.012], "ddp chorus": [0.006, 0.004], "ddp no_sync": [0.003, 0.003]})
    r1 = _rank({"ddp gloo": [0.011, 0.010], "ddp chorus": [0.005, 0.007], "ddp no_sync": [0.002, 0.004]})
    s = ddp.summarize([r0, r1], ["ddp no_sync", "ddp gloo", "ddp chorus"])
    assert s["variants"]["ddp gloo"]["steps"] == [0.011, 0.012]
    assert s["variants"]["ddp chorus"]["steps"] == [0.006, 0.007]
    assert s["variants"]["ddp chorus"]["min"] == 0.006
    assert s["ratios"]["ddp"]["median"] == pytest.approx(0.0065 / 0.0115)
    assert "all_reduce" not in s["ratios"]
    assert s["added"] == pytest.approx({"gloo": 0.0115 - 0.0035, "chorus": 0.0065 - 0.0035})
    assert s["losses_equal"] and s["loss_max_diff"] == 0.0
    table = ddp.format_table(s)
    assert table.splitlines()[0].split()[:3] == ["variant", "median", "ms"]
    assert [ln.split()[0] + " " + ln.split()[1] for ln in table.splitlines()[2:]] == ["ddp gloo", "ddp chorus"]
    assert table.splitlines()[-1].endswith("0.57x")


def test_different_losses_are_reported():
    r0 = _rank({"ddp gloo": [0.01], "ddp chorus": [0.01]})
    r0["losses"] = {"ddp chorus": [1.0, 0.6], "ddp gloo": [1.0, 0.5]}
    s = ddp.summarize([r0], ["ddp gloo", "ddp chorus"])
    assert not s["losses_equal"] and s["loss_max_diff"] == pytest.approx(0.1)


def test_parameters_of_the_default_model():
    assert ddp.parameters(2048, 4096) == 25_178_113  # bench-ddp's default MLP: about 25M parameters


@pytest.mark.parametrize("argv, message", [
    (["--variants", "ddp nccl"], "unknown"),
    (["--warmup", "1"], "at least 2"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    assert ddp.main(argv) == 2
    assert message in capsys.readouterr().err


def _spawned(rank, world, fn, args):
    """chorus.spawn's call, ``fn(i, *args)``, in a rank of proc_support.run_forked."""
    fn(rank, *args)


def test_tiny_real_run_shows_every_variant_and_equal_losses(tmp_path, monkeypatch, capsys):
    """The command's code in this process; its ranks are forks of the torch server instead
    of fresh interpreters (chorus.spawn itself: tests/test_spawn.py)."""
    monkeypatch.setattr("chorus.launch.spawn", lambda fn, args=(), nprocs=1: run_forked(_spawned, nprocs, fn, args))
    monkeypatch.delenv("CHORUS_TRANSPORT", raising=False)
    out_json = tmp_path / "ddp.json"
    code = ddp.main(["--world", "2", "--features", "16", "--hidden", "32", "--batch", "4", "--steps", "3",
                     "--bucket-cap-mb", "0.001", "--threads", "1", "--json", str(out_json)])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    lines = captured.out.splitlines()
    assert lines[0].startswith("# chorus bench-ddp: 2 ranks") and "MLP 16-32-32-1" in lines[0]
    rows = {" ".join(ln.split()[:2]) if ln.split()[0] != "compute" else "compute": ln
            for ln in lines if ln and not ln.startswith(("#", "variant"))}
    assert set(rows) == set(ddp.VARIANTS)
    assert rows["ddp chorus"].endswith("x") and rows["all_reduce chorus"].endswith("x")
    assert any(ln.startswith("# losses ddp chorus vs ddp gloo") and ln.endswith("(equal)") for ln in lines)
    assert any(ln.startswith("# added to a step by communication") for ln in lines)
    doc = json.loads(out_json.read_text())
    assert doc["losses_equal"] and len(doc["losses"]["ddp chorus"]) == 3
    assert doc["losses"]["ddp chorus"] == pytest.approx(doc["losses"]["ddp gloo"], rel=1e-6)
    assert len(doc["settings"]["buckets"]) > 1  # a tiny bucket cap: several buckets, reduced in turn
    assert doc["settings"]["parameters"] == ddp.parameters(16, 32)
    for v in doc["variants"].values():
        assert len(v["steps"]) == 3 and v["min"] > 0 and v["cpu"] >= 0


def test_on_gpus_the_baseline_is_nccl():
    """--device cuda: the same variants against NCCL, and its ratios and losses named so."""
    assert ddp.variants_for("nccl") == ("compute", "ddp no_sync", "ddp nccl", "ddp chorus", "all_reduce nccl",
                                        "all_reduce chorus")
    r0 = {"times": {"ddp nccl": [0.020, 0.022], "ddp chorus": [0.019, 0.021]},
          "cpu": {"ddp nccl": [0.01, 0.01], "ddp chorus": [0.01, 0.01]},
          "losses": {"ddp chorus": [1.0, 0.5], "ddp nccl": [1.0, 0.50000001]}, "buckets": [4096]}
    s = ddp.summarize([r0], ["ddp nccl", "ddp chorus"], "nccl")
    assert s["ratios"]["ddp"]["median"] == pytest.approx(0.020 / 0.021) and s["losses_equal"]
    table = ddp.format_table(s, "nccl")
    assert table.splitlines()[0].split()[-1] == "chorus/nccl" and table.splitlines()[-1].endswith("0.95x")


def test_on_gpus_without_enough_of_them_it_says_so(capsys, monkeypatch):
    pytest.importorskip("torch")
    import torch

    monkeypatch.delenv("CHORUS_BENCH_CUDA_DRY", raising=False)
    world = torch.cuda.device_count() + 1
    assert ddp.main(["--device", "cuda", "--world", str(world)]) == 2
    err = capsys.readouterr().err
    assert f"--device cuda --world {world}" in err and "one per rank" in err
    assert ddp.main(["--device", "cuda", "--world", str(world), "--variants", "ddp gloo"]) == 2  # NCCL's names
