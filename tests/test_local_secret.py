"""A job on one host without a token derives one (chorus/host/secret.py):
rank 0 writes a secret to a 0600 file in a private 0700 directory, the other ranks read it,
every store and transport connection proves it; a directory others may enter is refused;
an explicit token wins; CHORUS_LOCAL_SECRET=off turns it off."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from proc_support import REPO, reserved_port, run_ranks
from proc_support import reports as printed_reports

from chorus import net
from chorus.errors import AuthenticationError, RendezvousError
from chorus.host import secret
from chorus.launch import spawn
from chorus.rendezvous import rendezvous
from chorus.store import TCPStore

SCRIPT = Path(__file__).resolve().parent / "launch_scripts" / "auth_report.py"
NO_TOKEN = "no job token"


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def sdir(tmp_path):
    """Where the secrets go (CHORUS_LOCAL_SECRET_DIR): not there yet, rank 0 makes it."""
    return tmp_path / "secrets"


@pytest.fixture
def warnings(monkeypatch, caplog):
    """The chorus warnings logged during the test (the "no job token" one re-armed)."""
    monkeypatch.setattr(net, "_warned", False)
    caplog.set_level(logging.WARNING, logger="chorus")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "chorus"]


# -- the decision -------------------------------------------------------------------------------
@pytest.mark.parametrize("world,addr,local,launcher_world,expected", [
    (1, "10.0.0.1", None, None, True),          # nobody else to reach
    (4, "127.0.0.1", None, None, True),         # loopback: no other host can reach it
    (4, "127.3.2.1", 1, 4, True),
    (4, "localhost", None, None, True),
    (4, "::1", None, None, True),
    (4, "10.0.0.1", 4, 4, True),                # torchrun / chorusrun on one node
    (4, "node0", 2, 4, False),                  # two nodes
    (4, "10.0.0.1", None, None, False),         # nothing says where the others are
    (4, "10.0.0.1", 4, None, False),
    (4, "10.0.0.1", 4, 8, False),               # the launcher's world is not this one
    (4, "localhost.example.com", None, None, False),  # no name lookups
])
def test_one_host_is_decided_from_what_every_rank_knows(world, addr, local, launcher_world, expected):
    assert secret.single_host(world, addr, local, launcher_world) is expected


def test_the_key_is_the_jobs():
    key = secret.job_key("127.0.0.1", 29500, 2, {})
    assert key == secret.job_key("127.0.0.1", 29500, 2, {}) and len(key) == 32
    assert secret.job_key("127.0.0.1", 29500, 3, {}) == key  # a world-size mismatch meets (and is told)
    others = [secret.job_key("127.0.0.1", 29501, 2, {}),
              secret.job_key("127.0.0.1", 29500, 2, {"TORCHELASTIC_RUN_ID": "x"}),
              secret.job_key("127.0.0.1", 29500, 2, {"TORCHELASTIC_RESTART_COUNT": "1"}),
              secret.job_key("127.0.0.1", 29500, 2, {"CHORUS_JOB_ID": "j"})]
    assert len({key, *others}) == 5


# -- the file ---------------------------------------------------------------------------------------
def _derive(rank, sdir, world=2, timeout=5.0, **env):
    return secret.job_secret(rank, world, "127.0.0.1", 29500, timeout,
                             environ={"CHORUS_LOCAL_SECRET_DIR": str(sdir), **env})


def test_rank0_writes_a_0600_file_in_a_0700_directory_and_the_others_read_it(sdir):
    got = {}
    reader = threading.Thread(target=lambda: got.update(r1=_derive(1, sdir)))
    reader.start()  # waits for the file
    time.sleep(0.05)
    s0 = _derive(0, sdir)
    reader.join(10)
    assert s0.creator and not got["r1"].creator
    assert s0.token == got["r1"].token and len(s0.token) == 32
    st = os.lstat(sdir)
    assert stat.S_ISDIR(st.st_mode) and mode(sdir) == 0o700 and st.st_uid == os.getuid()
    (name,) = os.listdir(sdir)
    assert name.startswith("job-") and mode(sdir / name) == 0o600 and os.lstat(sdir / name).st_uid == os.getuid()
    got["r1"].release()  # a reader's release removes nothing
    assert os.listdir(sdir) == [name]
    s0.release()
    assert os.listdir(sdir) == []


def test_release_leaves_a_file_that_holds_another_secret(sdir):
    first = _derive(0, sdir)
    second = _derive(0, sdir)  # the same job name, written again: a later job's file
    first.release()
    assert len(os.listdir(sdir)) == 1
    second.release()
    assert os.listdir(sdir) == []


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_file_left_by_a_dead_rank0_is_not_read_and_is_swept(sdir):
    sdir.mkdir(mode=0o700)
    path = sdir / f"job-{secret.job_key('127.0.0.1', 29500, 2, {})}"
    ns = os.stat("/proc/self/ns/pid").st_ino
    path.write_text(f"{secret.MAGIC} {ns} {_dead_pid()} 1\n{'ab' * 32}\n")
    path.chmod(0o600)
    old = sdir / "job-0123456789abcdef0123456789abcdef"  # a live creator (us), but two days old
    old.write_text(f"{secret.MAGIC} {ns} {os.getpid()} \n{'cd' * 32}\n")
    old.chmod(0o600)
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        _derive(1, sdir, timeout=0.3)
    assert time.monotonic() - start < 3
    for part in ("rank 1 could not connect to", str(path), "CHORUS_TOKEN", "CHORUS_LOCAL_SECRET=off"):
        assert part in str(info.value)
    fresh = _derive(0, sdir)  # sweeps both, then writes its own
    assert os.listdir(sdir) == [path.name] and secret.read(str(path)) == (fresh.token, True)
    fresh.release()


@pytest.mark.parametrize("how", ["open to others", "symlink", "owned by another user"])
def test_a_directory_that_is_not_private_is_refused_with_a_warning(tmp_path, sdir, how, warnings):
    if how == "open to others":
        sdir.mkdir(mode=0o700)
        sdir.chmod(0o755)
    elif how == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        sdir.symlink_to(tmp_path / "real")
    else:
        if os.getuid() != 0:
            pytest.skip("only root can give a directory to another user")
        sdir.mkdir(mode=0o700)
        os.chown(sdir, 65534, 65534)
    assert _derive(0, sdir) is None and _derive(1, sdir) is None  # every rank decides alike
    assert os.listdir(sdir) == []
    messages = warnings()
    assert len(messages) == 2 and all(str(sdir) in m and "runs without a token" in m for m in messages)
    assert {"open to others": "mode is 755", "symlink": "not a directory",
            "owned by another user": "belongs to uid 65534"}[how] in messages[0]


def test_off_and_several_hosts_give_no_secret(sdir):
    assert _derive(0, sdir, CHORUS_LOCAL_SECRET="off") is None
    assert secret.job_secret(0, 2, "10.0.0.1", 29500, 1.0, local_world_size=1, launcher_world_size=2,
                             environ={"CHORUS_LOCAL_SECRET_DIR": str(sdir)}) is None
    assert not sdir.exists()


# -- rendezvous: ranks as threads -----------------------------------------------------------------
def _rendezvous_pair(env: dict) -> list:
    with reserved_port() as port:
        base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", **env}
        infos: list = [None, None]

        def rank_main(r):
            infos[r] = rendezvous(None, timeout=timedelta(seconds=10), environ=dict(base, RANK=str(r)))

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in (1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    assert None not in infos
    return infos


def test_a_tokenless_job_on_one_host_authenticates_its_store(sdir, warnings):
    infos = _rendezvous_pair({"CHORUS_LOCAL_SECRET_DIR": str(sdir)})
    try:
        assert infos[0].token == infos[1].token and len(infos[0].token) == 32
        assert infos[0].secret.creator and os.listdir(sdir) == []  # removed once both joined
        infos[1].store.set("k", b"v")
        assert infos[0].store.get("k") == b"v"
        with pytest.raises(AuthenticationError):  # a client that proves nothing is refused
            TCPStore("127.0.0.1", infos[0].master_port, timeout=5)
    finally:
        for info in reversed(infos):
            info.store.close()
    assert not any(NO_TOKEN in m for m in warnings())


@pytest.mark.parametrize("env,token", [({"CHORUS_TOKEN": "explicit"}, b"explicit"),
                                       ({"CHORUS_LOCAL_SECRET": "off"}, None)])
def test_an_explicit_token_wins_and_off_turns_it_off(sdir, env, token, warnings):
    infos = _rendezvous_pair({"CHORUS_LOCAL_SECRET_DIR": str(sdir), **env})
    for info in reversed(infos):
        info.store.close()
    assert [i.token for i in infos] == [token, token] and [i.secret for i in infos] == [None, None]
    assert not sdir.exists()  # no secret was ever written
    assert any(NO_TOKEN in m for m in warnings()) is (token is None)


# -- whole jobs -----------------------------------------------------------------------------------------
def reports(text: str) -> dict[int, dict]:
    return {r["rank"]: r for r in printed_reports(text)}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CHORUS_TOKEN"}
    return env | extra


AUTHENTICATED = {0: {"rank": 0, "authenticated": True, "transport_refuses": True, "store_refuses": True,
                     "objects": [0, 1]},
                 1: {"rank": 1, "authenticated": True, "objects": [0, 1]}}


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["auto", "off"])
def test_ranks_started_by_hand_on_one_host(sdir, setting):
    procs, outs = run_ranks([sys.executable, str(SCRIPT)], 2,
                            env=_env(CHORUS_LOCAL_SECRET_DIR=str(sdir), CHORUS_LOCAL_SECRET=setting))
    assert [p.returncode for p in procs] == [0, 0], outs
    got = reports("".join(out for out, _ in outs))
    stderr = "".join(err for _, err in outs)
    if setting == "auto":
        assert got == AUTHENTICATED and NO_TOKEN not in stderr
        assert mode(sdir) == 0o700 and os.listdir(sdir) == []
    else:  # the same job without the secret: open, and warned
        assert [got[r]["authenticated"] for r in (0, 1)] == [False, False]
        assert (got[0]["transport_refuses"], got[0]["store_refuses"], got[0]["objects"]) == (False, False, "refused")
        assert NO_TOKEN in stderr and not sdir.exists()


@pytest.mark.slow
def test_chorusrun_on_one_node():
    r = subprocess.run([sys.executable, "-m", "chorus.run", "--nproc-per-node", "2", "--master-port", "0",
                        str(SCRIPT)], env=_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert reports(r.stdout) == AUTHENTICATED and NO_TOKEN not in r.stderr + r.stdout


def spawned_report(i: int, port: int, out_dir: str) -> None:
    spec = importlib.util.spec_from_file_location("auth_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["auth_report"] = module  # its Point must unpickle in the peer
    spec.loader.exec_module(module)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(i), WORLD_SIZE="2")
    Path(out_dir, f"{i}.json").write_text(json.dumps(module.chorus_job()))


@pytest.mark.slow
def test_chorus_spawn(tmp_path, monkeypatch):
    monkeypatch.delenv("CHORUS_TOKEN", raising=False)
    with reserved_port() as port:
        spawn(spawned_report, args=(port, str(tmp_path)), nprocs=2)
    assert {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)} == AUTHENTICATED


@pytest.mark.slow
def test_torch_backend_on_one_host(sdir):
    pytest.importorskip("torch")
    procs, outs = run_ranks([sys.executable, str(SCRIPT), "torch"], 2, env=_env(CHORUS_LOCAL_SECRET_DIR=str(sdir)))
    assert [p.returncode for p in procs] == [0, 0], outs
    assert reports("".join(out for out, _ in outs)) == {0: {"rank": 0, "authenticated": True},
                                                        1: {"rank": 1, "authenticated": True}}
    assert NO_TOKEN not in "".join(err for _, err in outs) and os.listdir(sdir) == []
