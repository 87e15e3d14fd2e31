"""Tier 2: real processes over TCP (init methods, large messages, failures, intruders)."""

import contextlib
import os
import random
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from proc_support import reserved_port

import chorus as dist
from chorus.testing import run_processes

BIG = 32 << 20  # bytes: the size is not the point (tests/test_big_messages.py has 2.5 GiB), many reads are


def _pairs_body(rank, world):
    out = {}
    for dtype in ("int64", "float16", "complex64", "bool"):
        for n in (0, 1, 1000):
            for src in range(world):
                for dst in range(world):
                    if src == dst or rank not in (src, dst):
                        continue
                    data = (np.arange(n) * (src + 1) + dst).astype(dtype)
                    if rank == src:
                        dist.send(data, dst=dst)
                    else:
                        buf = np.zeros(n, dtype)
                        dist.recv(buf, src=src)
                        out[(dtype, n, src)] = bool(np.array_equal(buf, data))
    # any-source: everyone sends its rank to rank 0
    if rank == 0:
        senders = sorted(dist.recv(np.zeros(1, np.int64)) for _ in range(world - 1))
        out["any"] = senders == list(range(1, world))
    else:
        dist.send(np.array([rank], np.int64), dst=0)
    # a large message (many reads into the posted buffer): 32 MiB from the last rank to rank 0
    big = np.arange(BIG // 4, dtype=np.int32)
    if rank == world - 1:
        dist.send(big, dst=0)
    elif rank == 0:
        buf = np.empty_like(big)
        dist.recv(buf, src=world - 1)
        out["big"] = bool(np.array_equal(buf, big))
    dist.barrier()
    return out


def test_all_pairs_dtypes_any_source_and_a_large_message_over_tcp(monkeypatch):
    monkeypatch.setenv("CHORUS_TRANSPORT", "tcp")  # no shared-memory rings for the large one
    results = run_processes(_pairs_body, 3)
    checks = [v for r in results for v in r.values()]
    assert len(checks) == 4 * 3 * 6 + 2 and all(checks)


_INIT_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, chorus as dist
    mode, rank, world, where = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if mode == "tcp":
        dist.init_process_group("gloo", init_method=f"tcp://{where}", rank=rank, world_size=world)
    elif mode == "file":
        dist.init_process_group("gloo", init_method=f"file://{where}", rank=rank, world_size=world)
    elif mode == "store":
        host, port = where.split(":")
        store = dist.TCPStore(host, int(port), world, is_master=(rank == 0))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo")  # env://
    t = np.array([dist.get_rank()], np.int64)
    dist.send(t, dst=(rank + 1) % world); dist.recv(t, src=(rank - 1) % world)
    dist.barrier()
    print("OK", dist.get_rank(), dist.get_world_size(), int(t[0]))
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("mode", ["tcp", "file", "store", "env"])
def test_init_methods(mode, tmp_path):
    world = 2
    with reserved_port() as port:
        where = str(tmp_path / "rdzv") if mode == "file" else f"127.0.0.1:{port}"
        script = tmp_path / "init.py"
        script.write_text(_INIT_SCRIPT)
        procs = []
        for rank in range(world):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(world))
            env.pop("CHORUS_TOKEN", None)
            procs.append(subprocess.Popen([sys.executable, str(script), mode, str(rank), str(world), where],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        outs = [p.communicate(timeout=60) for p in procs]
    for rank, (out, err) in enumerate(outs):
        assert procs[rank].returncode == 0, err
        assert out.strip() == f"OK {rank} {world} {(rank - 1) % world}"


def test_address_in_use_names_host_port_and_fix():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(dist.RendezvousError, match=rf"127\.0\.0\.1:{port}.*--master-port 0"):
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                    timeout=5)
    assert not dist.is_initialized()


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, numpy as np, chorus as dist
    victim, outdir, how, ready_dir, everyone = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if rank == victim:  # once every survivor (of every job started together) is about to wait
        while len(os.listdir(ready_dir)) < everyone:
            time.sleep(0.01)
        open(f"{outdir}/killed", "w").write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    open(f"{ready_dir}/{os.getpid()}", "w").close()
    try:
        dist.recv(np.zeros(1), src=(rank + 1) % world)  # most ranks wait on a live peer
    except dist.PeerLostError as exc:
        open(f"{outdir}/rank{rank}", "w").write(repr(time.time()) + "\\n" + str(exc))
        sys.exit(3)
""")
WORLD = 3


def _start_victim_job(outdir, victim, how, ready_dir, everyone, port, extra_env=None):
    outdir.mkdir()
    script = outdir / "kill.py"
    script.write_text(_KILL_SCRIPT)
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(WORLD), CHORUS_TOKEN="kill-test-token", **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, str(script), str(victim), str(outdir), how, str(ready_dir),
                                       str(everyone)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    return procs


def _finish_victim_job(outdir, victim, procs):
    """{survivor: (seconds from the kill to its PeerLostError, the message)}."""
    try:
        errs = {rank: p.communicate(timeout=60)[1] for rank, p in enumerate(procs) if rank != victim}
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    killed_at = float((outdir / "killed").read_text())
    delays = {}
    for rank in range(WORLD):
        if rank == victim:
            continue
        assert procs[rank].returncode == 3, f"rank {rank} exited {procs[rank].returncode}: {errs[rank][-2000:]}"
        when, message = (outdir / f"rank{rank}").read_text().split("\n", 1)
        assert f"rank {victim}" in message
        delays[rank] = (float(when) - killed_at, message)
    return delays


def _victim_jobs(tmp_path, victims, how, extra_env=None):
    """One job per victim, all started together; each victim dies once every survivor of
    every job waits.  Returns {victim: delays}."""
    ready = tmp_path / "ready"
    ready.mkdir()
    everyone = len(victims) * (WORLD - 1)
    with contextlib.ExitStack() as ports:
        jobs = {v: _start_victim_job(tmp_path / f"victim{v}", v, how, ready, everyone,
                                     ports.enter_context(reserved_port()), extra_env) for v in victims}
        return {v: _finish_victim_job(tmp_path / f"victim{v}", v, procs) for v, procs in jobs.items()}


def test_sigkill_of_any_rank_makes_every_survivor_raise_peer_lost_within_5s(tmp_path):
    """Victim 0 hosts the store; the others' left neighbours wait on them directly."""
    for victim, delays in _victim_jobs(tmp_path, range(WORLD), "kill").items():
        assert all(delay < 5.0 for delay, _ in delays.values()), (victim, delays)


def test_a_silent_rank_is_declared_lost_after_the_heartbeat_timeout(tmp_path):
    delays = _victim_jobs(tmp_path, [1], "stop", {"CHORUS_HEARTBEAT_TIMEOUT": "2"})[1]
    for delay, message in delays.values():
        # silence counts from the victim's last frame, sent up to ~1 s before it stopped
        assert 0.5 < delay < 6.0 and "stopped answering" in message, (delay, message)


def _intruder_body(rank, world):
    """Rank 0 attacks every transport listener and the store while all ranks exchange data."""
    import threading

    from chorus.api.state import current

    stop = threading.Event()
    rejected = []

    def closed_by_server(sock, payloads):
        """Send ``payloads``; True once the server has closed the connection on us."""
        try:
            for data in payloads:
                sock.sendall(data)
            sock.settimeout(10)
            while sock.recv(1 << 16):
                pass
            return True  # EOF: the server closed it
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False  # still open: not rejected

    def attack():
        rng = random.Random(1)
        store = current().store
        for peer in range(1, world):
            host, port = store.get(f"tcp/addr/{peer}").decode().rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=5) as s:  # no token, garbage
                rejected.append(closed_by_server(s, [rng.randbytes(64)]))
            with socket.create_connection((host, int(port)), timeout=5) as s:  # 10,000 random frames
                rejected.append(closed_by_server(s, (rng.randbytes(44) for _ in range(10_000))))
        stop.set()

    attacker = threading.Thread(target=attack) if rank == 0 else None
    if attacker:
        attacker.start()
    total = 0
    for i in range(300):
        t = np.full(1000, rank * 1000 + i, np.int64)
        r = np.empty(1000, np.int64)
        reqs = [dist.irecv(r, src=(rank - 1) % world), dist.isend(t, dst=(rank + 1) % world)]
        for q in reqs:
            q.wait()
        assert (r == ((rank - 1) % world) * 1000 + i).all()
        total += 1
    if attacker:
        attacker.join(60)
        assert stop.is_set() and rejected == [True] * 2 * (world - 1)
    dist.barrier()
    return total


def test_intruders_are_rejected_and_the_job_goes_on(monkeypatch):
    monkeypatch.setenv("CHORUS_TOKEN", "intruder-test-token")
    assert run_processes(_intruder_body, 4) == [300] * 4
