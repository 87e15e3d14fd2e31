"""End-to-end tests of ``chorusrun`` (run as ``python -m chorus.run``) with real processes."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_support import is_alive, wait_until

from chorus.launch.supervisor import RankSpec, Supervisor

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"
PREFIX = re.compile(r"^\[rank(\d+)\]:")


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("CHORUS_TOKEN", None)
    env.update(extra or {})
    return env


def chorusrun(*args: str, timeout: float = 30, env: dict | None = None):
    """Run the launcher to completion from the scripts folder; return the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "chorus.run", *args], cwd=SCRIPTS,
                          env=_env(env), capture_output=True, text=True, timeout=timeout)


def start_chorusrun(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "chorus.run", *args], cwd=SCRIPTS,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def by_rank(text: str) -> dict[int, list[str]]:
    """Split prefixed launcher output into each rank's lines; every line must be prefixed."""
    lines: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = PREFIX.match(line)
        assert m, f"line without [rankN]: prefix: {line!r}"
        lines.setdefault(int(m.group(1)), []).append(line[m.end():])
    return lines


def rank_envs(stdout: str) -> dict[int, dict]:
    out = {}
    for rank, lines in by_rank(stdout).items():
        (env_line,) = [ln for ln in lines if ln.startswith("ENV ")]
        out[rank] = json.loads(env_line[4:])
    return out


def wait_for_pids(pid_dir: Path, n: int, timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(pid_dir.glob("*.pid"))
        if len(files) == n:
            return [int(f.read_text()) for f in files]
        time.sleep(0.02)
    raise AssertionError(f"only {len(list(pid_dir.glob('*.pid')))} of {n} ranks started")


def read_pids(pid_dir: Path) -> list[int]:
    return [int(f.read_text()) for f in pid_dir.glob("*.pid")]


@pytest.fixture
def pid_dir(tmp_path):
    """A folder where ranks write their pids; any rank still alive at the end is killed."""
    yield tmp_path
    for pid in read_pids(tmp_path):
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_env_prefixes_and_streams_for_four_ranks():
    r = chorusrun("--nproc-per-node", "4", "--master-port", "0", "print_env.py")
    assert r.returncode == 0, r.stderr
    envs = rank_envs(r.stdout)
    assert sorted(envs) == [0, 1, 2, 3]
    port = envs[0]["env"]["MASTER_PORT"]
    token = envs[0]["env"]["CHORUS_TOKEN"]
    job = envs[0]["env"]["CHORUS_JOB_ID"]
    assert int(port) > 0 and re.fullmatch(r"[0-9a-f]{32}", token) and job
    for rank, info in envs.items():
        e = info["env"]
        assert (e["RANK"], e["LOCAL_RANK"]) == (str(rank), str(rank))
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == ("4", "4", "0")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("127.0.0.1", port)
        assert (e["CHORUS_TOKEN"], e["CHORUS_JOB_ID"], e["TORCHELASTIC_RUN_ID"]) == (token, job, job)
        assert (e["PYTHONUNBUFFERED"], e["CHORUS_STORE_HOSTED"]) == ("1", "1")
        assert e["CHORUS_STORE_PORT"] != port  # MASTER_PORT is left to torch's env://
        assert info["argv"] == []
    out, err = by_rank(r.stdout), by_rank(r.stderr)
    for rank in range(4):
        # partial last line is flushed at exit; stderr goes to stderr only
        assert out[rank][1:] == [f"second stdout line of rank {rank}",
                                 f"partial last line of rank {rank}"]
        assert err[rank] == [f"stderr line of rank {rank}"]
    assert "stderr line" not in r.stdout


def test_token_and_run_id_flags_and_env():
    r = chorusrun("--nproc_per_node=2", "--master_port=0", "--token", "s3cret",
                  "--run-id", "job42", "print_env.py")
    assert r.returncode == 0, r.stderr
    for info in rank_envs(r.stdout).values():
        assert info["env"]["CHORUS_TOKEN"] == "s3cret"
        assert info["env"]["CHORUS_JOB_ID"] == info["env"]["TORCHELASTIC_RUN_ID"] == "job42"
    # the value is in the launcher's /proc/PID/cmdline: one warning line says so and what instead
    (warning,) = [ln for ln in r.stderr.splitlines() if ln.startswith("chorusrun: warning")]
    assert "/proc/PID/cmdline" in warning and "--token-file" in warning and "CHORUS_TOKEN" in warning
    r = chorusrun("--nproc-per-node", "2", "--standalone", "print_env.py",
                  env={"CHORUS_TOKEN": "from-env"})
    assert r.returncode == 0, r.stderr
    assert {i["env"]["CHORUS_TOKEN"] for i in rank_envs(r.stdout).values()} == {"from-env"}


def test_token_file_gives_the_ranks_the_token_through_their_environment_only(tmp_path):
    path = tmp_path / "token"
    path.write_text("  from-a-file\n")
    path.chmod(0o600)
    r = chorusrun("--nproc-per-node", "2", "--master-port", "0", "--token-file", str(path), "print_env.py",
                  env={"CHORUS_TOKEN": "from-env"})  # the file wins
    assert r.returncode == 0, r.stderr
    assert "warning" not in r.stderr
    envs = rank_envs(r.stdout)
    assert sorted(envs) == [0, 1]
    for info in envs.values():
        assert info["env"]["CHORUS_TOKEN"] == "from-a-file" and "from-a-file" not in info["argv"]
    # the ranks prove the file's token to the store the launcher hosts with it
    r = chorusrun("--nproc-per-node", "2", "--master-port", "0", "--token-file", str(path), "store_count.py")
    assert r.returncode == 0, r.stderr
    assert sorted(by_rank(r.stdout)) == [0, 1]


@pytest.mark.parametrize("content, hint", [
    (None, "cannot read it (No such file or directory)"),
    ("  \n", "the file is empty"),
    (b"\xff\xfe", "cannot read it"),
])
def test_an_unusable_token_file_is_refused_before_any_rank_starts(tmp_path, capsys, content, hint):
    from chorus.launch.cli import main

    path = tmp_path / "token"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert main(["--token-file", str(path), "print_env.py"]) == 2
    captured = capsys.readouterr()
    assert f"--token-file {path}: {hint}" in captured.err and "chmod 600" in captured.err
    assert "ENV" not in captured.out


def test_a_token_file_others_can_read_warns_and_token_with_token_file_is_refused(tmp_path, capsys):
    from chorus.launch.cli import Job, UsageError, build_parser, main

    path = tmp_path / "token"
    path.write_text("tok\n")
    path.chmod(0o640)
    job = Job(build_parser().parse_args(["--token-file", str(path), "print_env.py"]))
    assert job.token == "tok"
    assert job.warnings == [f"the token file {path} can be read by other users (mode 640); chmod 600 {path}"]
    path.chmod(0o600)
    assert Job(build_parser().parse_args(["--token-file", str(path), "x.py"])).warnings == []
    with pytest.raises(UsageError, match="either --token-file or --token"):
        Job(build_parser().parse_args(["--token-file", str(path), "--token", "t", "x.py"]))
    assert main(["--token-file", str(path), "--token", "t", "print_env.py"]) == 2
    assert "not both" in capsys.readouterr().err


def test_log_dir_writes_one_raw_file_per_rank(tmp_path):
    r = chorusrun("--nproc-per-node", "2", "--master-port", "0", "--log-dir",
                  str(tmp_path / "logs"), "print_env.py")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    for rank in range(2):
        text = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        assert f'"RANK": "{rank}"' in text and "[rank" not in text
        assert f"second stdout line of rank {rank}\n" in text
        assert f"stderr line of rank {rank}\n" in text
        assert f"partial last line of rank {rank}" in text
        other = 1 - rank
        assert f"of rank {other}" not in text


def test_module_and_script_args_pass_through_unchanged():
    script_args = ["--lr", "0.1", "-x", "--nproc-per-node", "7", "positional", "--", "-m"]
    r = chorusrun("--nproc-per-node", "2", "--master-port", "0", "-m", "print_env",
                  *script_args)
    assert r.returncode == 0, r.stderr
    envs = rank_envs(r.stdout)
    assert sorted(envs) == [0, 1]
    assert all(info["argv"] == script_args for info in envs.values())


def test_nproc_auto_with_standalone():
    r = chorusrun("--standalone", "--nproc-per-node", "auto", "print_env.py")
    assert r.returncode == 0, r.stderr
    envs = rank_envs(r.stdout)
    n = os.cpu_count()
    assert sorted(envs) == list(range(n))
    assert {i["env"]["WORLD_SIZE"] for i in envs.values()} == {str(n)}
    ports = {i["env"]["MASTER_PORT"] for i in envs.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0


def test_first_failure_stops_everyone_and_reports_it(pid_dir):
    start = time.monotonic()
    r = chorusrun("--nproc-per-node", "4", "--master-port", "0", "ranks_behave.py",
                  str(pid_dir), "--fail-rank", "2", "--stubborn-rank", "3")
    ended = time.time()
    assert r.returncode == 1
    assert time.monotonic() - start < 15
    failed_at = float((pid_dir / "failed_at").read_text())
    # rank 3 ignores SIGTERM: it needed the SIGKILL, and still all stopped within 5 s
    assert 2.0 < ended - failed_at < 5.5
    pids = read_pids(pid_dir)
    assert len(pids) == 4 and not any(is_alive(p) for p in pids)
    report = r.stderr[r.stderr.index("=" * 72):]
    rank2_pid = int((pid_dir / "2.pid").read_text())
    assert f"rank 2 (local rank 2, pid {rank2_pid}) failed first: exited with code 1" in report
    assert "ValueError: boom from rank 2" in report
    assert "in inner_step" in report and "in outer_step" in report


def test_rank_killed_by_signal_is_reported_by_name(pid_dir):
    r = chorusrun("--nproc-per-node", "2", "--master-port", "0", "ranks_behave.py",
                  str(pid_dir), "--fail-rank", "1", "--mode", "sigkill")
    assert r.returncode == 128 + signal.SIGKILL
    assert "rank 1 (local rank 1" in r.stderr
    assert "killed by signal SIGKILL" in r.stderr
    assert not any(is_alive(p) for p in read_pids(pid_dir))


def test_of_ranks_found_dead_at_one_look_the_one_killed_by_a_signal_failed_first():
    # rank 0 exits 3 (as a survivor raising PeerLostError would), rank 1 is SIGKILLed; both are
    # dead before the supervisor's first look, so only the tie-break can name the crash
    code = ("import os, signal, sys; os.kill(os.getpid(), signal.SIGKILL) "
            "if os.environ['RANK'] == '1' else sys.exit(3)")
    specs = [RankSpec(r, r, [sys.executable, "-c", code], dict(os.environ, RANK=str(r))) for r in range(2)]
    sup = Supervisor(specs, stdout=io.StringIO(), stderr=io.StringIO())
    sup.start()
    assert wait_until(lambda: not any(is_alive(p) for p in sup.pids()), 30)
    outcome = sup.run()
    assert (outcome.first_failure.rank, outcome.first_failure.signal_name) == (1, "SIGKILL")
    assert outcome.exit_code == 128 + signal.SIGKILL


def test_sigterm_to_launcher_is_forwarded(pid_dir):
    proc = start_chorusrun("--nproc-per-node", "3", "--master-port", "0", "ranks_behave.py",
                           str(pid_dir))
    pids = wait_for_pids(pid_dir, 3)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    assert time.monotonic() - sent < 5
    assert proc.returncode == 128 + signal.SIGTERM
    assert "received SIGTERM" in err
    assert not any(is_alive(p) for p in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_ranks_die_when_launcher_is_sigkilled(pid_dir):
    proc = start_chorusrun("--nproc-per-node", "2", "--master-port", "0", "ranks_behave.py",
                           str(pid_dir))
    pids = wait_for_pids(pid_dir, 2)
    proc.kill()
    proc.communicate(timeout=10)
    deadline = time.monotonic() + 3
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(is_alive(p) for p in pids)


def test_busy_master_port_gives_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = chorusrun("--nproc-per-node", "2", "--master-port", str(port), "print_env.py")
    assert r.returncode != 0
    assert f"127.0.0.1:{port}" in r.stderr
    assert "--master-port 0" in r.stderr
    assert "ENV" not in r.stdout  # no rank was started


@pytest.mark.parametrize("argv, hint", [
    (["--standalone", "--nnodes", "2"], "drop --standalone"),
    (["--nnodes", "1:4"], "pass a fixed count such as --nnodes 4"),
    (["--nproc-per-node", "zero"], "expected an integer, 'auto' or 'cpu'"),
    (["--nnodes", "2", "--node-rank", "2"], "must be in 0..1"),
    (["--nnodes", "2", "--node-rank", "1", "--master-port", "0"], "node 0's real port"),
    (["-m", "--no-python"], "cannot be combined"),
])
def test_usage_errors_say_what_to_change(argv, hint, capsys):
    from chorus.launch.cli import main

    assert main([*argv, "print_env.py"]) == 2  # refused before anything starts
    assert hint in capsys.readouterr().err


def test_ranks_reach_the_store_hosted_by_the_launcher():
    r = chorusrun("--nproc-per-node", "3", "--master-port", "0", "store_count.py")
    assert r.returncode == 0, r.stderr
    lines = by_rank(r.stdout)
    assert {rank: ln for rank, ln in lines.items()} == {
        rank: [f"rank {rank} saw 3 ranks in the store"] for rank in range(3)}


def test_two_nodes_number_ranks_by_node_and_agree_on_the_job_id():
    node0 = chorusrun("--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2",
                      "--master-port", "0", "--token", "tok", "print_env.py")
    assert node0.returncode == 0, node0.stderr
    env0 = rank_envs(node0.stdout)
    port = env0[0]["env"]["CHORUS_STORE_PORT"]  # the store's port, which node 0 picked
    node1 = chorusrun("--nnodes=2:2", "--node_rank=1", "--nproc_per_node=2",
                      f"--master_port={port}", "--token", "tok", "print_env.py")
    assert node1.returncode == 0, node1.stderr
    env1 = rank_envs(node1.stdout)
    assert sorted(env0) == [0, 1] and sorted(env1) == [2, 3]
    for rank, info in {**env0, **env1}.items():
        e = info["env"]
        assert e["LOCAL_RANK"] == str(rank % 2) and e["GROUP_RANK"] == str(rank // 2)
        assert (e["WORLD_SIZE"], e["CHORUS_STORE_PORT"], e["CHORUS_TOKEN"]) == ("4", port, "tok")
        assert e["MASTER_PORT"] == str(int(port) + 1)  # torch's own rendezvous: the next port
    assert len({i["env"]["CHORUS_JOB_ID"] for i in [*env0.values(), *env1.values()]}) == 1


def test_several_nodes_without_token_warn_they_are_unauthenticated():
    r = chorusrun("--nnodes", "2", "--node-rank", "1", "--master-port", "29999",
                  "print_env.py")
    assert r.returncode == 0, r.stderr
    assert "unauthenticated" in r.stderr
    assert rank_envs(r.stdout)[1]["env"]["CHORUS_TOKEN"] is None


@pytest.mark.slow
def test_a_plain_torch_gloo_script_runs_under_chorusrun():
    """torch's own env:// rendezvous: its rank 0 binds MASTER_PORT, which the launcher leaves
    free (its store is on CHORUS_STORE_PORT)."""
    pytest.importorskip("torch")
    r = chorusrun("--nproc-per-node", "2", "--master-port", "0", "torch_gloo.py", timeout=90)
    assert r.returncode == 0, r.stderr
    assert by_rank(r.stdout) == {0: ["rank 0 of 2: 3"], 1: ["rank 1 of 2: 3"]}


def test_nodes_started_with_different_sizes_fail_fast_naming_them():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    start = time.monotonic()
    nodes = [subprocess.Popen([sys.executable, "-m", "chorus.run", "--nnodes", "2", "--node-rank", str(n),
                               "--nproc-per-node", str(n + 1), "--master-port", port, "--token", "t",
                               "all_reduce_job.py"], cwd=SCRIPTS, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outputs = [p.communicate(timeout=60) for p in nodes]
    assert time.monotonic() - start < 10
    for p, (_, err) in zip(nodes, outputs, strict=True):
        assert p.returncode == 1
        # node 0's rank 0 says 2 (1 rank per node), node 1's ranks 2 and 3 say 4
        assert re.search(r"the ranks disagree on the size of the job: rank (0 says world_size 2, rank [23] says 4"
                         r"|[23] says world_size 4, rank 0 says 2)", err), err
