"""Tier 2: real processes over TCP (init methods, large messages, failures, intruders)."""

import os
import random
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import chorus as dist
from chorus.testing import run_processes


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
    dist.barrier()
    return out


def test_all_pairs_dtypes_and_any_source_over_tcp():
    results = run_processes(_pairs_body, 3)
    checks = [v for r in results for v in r.values()]
    assert len(checks) == 4 * 3 * 6 + 1 and all(checks)


def _big_body(rank, world):
    n = (256 << 20) // 4  # 256 MiB of float32
    if rank == 0:
        data = np.arange(n, dtype=np.float32)
        dist.send(data, dst=1)
        return None
    buf = np.empty(n, np.float32)
    dist.recv(buf, src=0)
    return bool(buf[0] == 0 and buf[-1] == n - 1 and buf[n // 3] == n // 3)


def test_256_mib_message():
    assert run_processes(_big_body, 2)[1] is True


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    world, port = 3, _free_port()
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
    victim, outdir, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if rank == victim:
        time.sleep(0.5)
        open(f"{outdir}/killed", "w").write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    try:
        dist.recv(np.zeros(1), src=(rank + 1) % world)  # most ranks wait on a live peer
    except dist.PeerLostError as exc:
        open(f"{outdir}/rank{rank}", "w").write(repr(time.time()) + "\\n" + str(exc))
        sys.exit(3)
""")


def _run_victim_job(tmp_path, victim, how, extra_env=None):
    world, port = 4, _free_port()
    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT)
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), CHORUS_TOKEN="kill-test-token", **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, str(script), str(victim), str(tmp_path), how],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        for rank, p in enumerate(procs):
            if rank != victim:
                p.communicate(timeout=60)
    finally:
        procs[victim].kill()
        procs[victim].communicate()
    killed_at = float((tmp_path / "killed").read_text())
    delays = {}
    for rank in range(world):
        if rank == victim:
            continue
        assert procs[rank].returncode == 3, f"rank {rank} exited {procs[rank].returncode}"
        when, message = (tmp_path / f"rank{rank}").read_text().split("\n", 1)
        assert f"rank {victim}" in message
        delays[rank] = (float(when) - killed_at, message)
    return delays


@pytest.mark.parametrize("victim", [0, 1, 2, 3])
def test_sigkill_of_one_rank_makes_every_survivor_raise_peer_lost_within_5s(victim, tmp_path):
    delays = _run_victim_job(tmp_path, victim, "kill")
    assert all(delay < 5.0 for delay, _ in delays.values()), delays


def test_a_silent_rank_is_declared_lost_after_the_heartbeat_timeout(tmp_path):
    delays = _run_victim_job(tmp_path, 1, "stop", {"CHORUS_HEARTBEAT_TIMEOUT": "2"})
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
            host, port = store.get(f"chorus/1/tcp/addr/{peer}").decode().rsplit(":", 1)
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
