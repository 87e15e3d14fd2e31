"""Point-to-point between processes of one host through shared-memory rings
(chorus.transport.shm_link, chorus.transport.ring): every P2P API, any-source, tags,
out-of-order posting, mismatches, big messages, a TCP-schedule collective, the off
switches, nothing left in /dev/shm, and a killed writer or reader -> PeerLostError
within 5 s.  The rings' byte counters prove the payloads really went through them."""

import ast
import contextlib
import glob
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from proc_support import leftovers, reserved_port

import chorus as dist
from chorus.testing import run_processes
from chorus.transport.ring import ALIGN, ALIGN_AT, RingReader, RingWriter, ring_size

MIB = 1 << 20


@pytest.fixture
def job(job, monkeypatch):
    """conftest's fresh CHORUS_JOB_ID (nothing of it left at the end), with rings on."""
    for name in ("CHORUS_SHM_P2P", "CHORUS_SHM_P2P_BYTES", "CHORUS_SHM_P2P_MIN", "CHORUS_TRANSPORT",
                 "CHORUS_HOST_ID"):
        monkeypatch.delenv(name, raising=False)
    return job


def _stats():
    """{peer: (bytes sent, bytes received)} through this rank's rings."""
    return dist.group.WORLD.transport.shm_p2p_stats()


def _pattern(seed, n, dtype=np.float32):
    return (np.arange(n, dtype=np.int64) * 7 + seed).astype(dtype)


# -- the ring alone ----------------------------------------------------------------------------

def test_ring_streams_messages_larger_than_itself_with_wrap_around_and_skips():
    """Two threads, one ring of 64 KiB: messages of every size (up to 40x the ring), some
    discarded, arrive intact and in order; each starts 2 KiB into a 4 KiB page of the ring."""
    size = 64 << 10
    buf = mmap.mmap(-1, ring_size(size))
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(1, 3 * size, 200)] + [40 * size, 1, ALIGN, size]
    bells = []

    def doze(seconds):  # no socket here: sleep, as if no bell came (the timeout path)
        time.sleep(min(seconds, 1e-4))
        return False

    writer = RingWriter(buf, 0, size, bell=lambda: bells.append(1), piece=16 << 10, yield_s=1e-5)
    reader = RingReader(buf, 0, size, doze=doze, peer=0, piece=16 << 10, yield_s=1e-5)
    got, starts = [], []

    def read():
        for i, n in enumerate(sizes):
            starts.append((reader.tail + (ALIGN_AT - reader.tail) % ALIGN) % ALIGN)
            if i % 7 == 3:
                reader.discard(n)
                got.append(None)
            else:
                out = np.empty(n, np.uint8)
                reader.read_into(memoryview(out))
                got.append(out)

    t = threading.Thread(target=read)
    t.start()
    for i, n in enumerate(sizes):
        writer.write(memoryview((np.arange(n) * 31 + i).astype(np.uint8)))
    t.join(30)
    assert not t.is_alive()
    for i, n in enumerate(sizes):
        if got[i] is not None:
            np.testing.assert_array_equal(got[i], (np.arange(n) * 31 + i).astype(np.uint8))
    assert set(starts) == {ALIGN_AT} and writer.bytes == reader.bytes == sum(sizes)


# -- every API through the rings ------------------------------------------------------------

def _every_api(rank, world):
    from chorus.errors import BufferMismatchError

    job = os.environ["CHORUS_JOB_ID"]
    out = {"files_while_running": glob.glob(f"/dev/shm/chorus-{job}-*")}
    # send / recv, sizes below and above the ring threshold (256 KiB) and the ring (4 MiB)
    sizes = [0, 1000, 300_000, 4 * MIB + 13, 64 * MIB]
    for n in sizes:
        if rank == 0:
            dist.send(_pattern(n, n // 4), dst=1)
        elif rank == 1:
            buf = np.empty(n // 4, np.float32)
            assert dist.recv(buf, src=0) == 0
            out[f"send_recv_{n}"] = bool(np.array_equal(buf, _pattern(n, n // 4)))
    # isend / irecv posted in the reverse order of the sends, one tag each
    if rank == 0:
        works = [dist.isend(_pattern(tag, MIB // 4 + tag), dst=2, tag=tag) for tag in (1, 2, 3)]
        for w in works:
            w.wait()
    elif rank == 2:
        bufs = {tag: np.empty(MIB // 4 + tag, np.float32) for tag in (3, 2, 1)}
        works = [dist.irecv(bufs[tag], src=0, tag=tag) for tag in (3, 2, 1)]
        for w in works:
            w.wait()
        out["tags_reversed"] = all(np.array_equal(bufs[t], _pattern(t, MIB // 4 + t)) for t in bufs)
    # one tag, mixed sizes: order is kept whether the payload rides the socket or the ring
    mixed = [10, 2 * MIB, 3, MIB, 1]
    if rank == 1:
        for i, n in enumerate(mixed):
            dist.send(_pattern(i, n), dst=2, tag=7)
    elif rank == 2:
        ok = []
        for i, n in enumerate(mixed):
            buf = np.empty(n, np.float32)
            dist.recv(buf, src=1, tag=7)
            ok.append(bool(np.array_equal(buf, _pattern(i, n))))
        out["mixed_order"] = all(ok)
    # any source: ranks 1 and 2 send 2 MiB each to rank 0
    if rank == 0:
        seen = {}
        for _ in range(world - 1):
            buf = np.empty(MIB // 2, np.float32)
            src = dist.recv(buf, tag=9)
            seen[src] = bool(np.array_equal(buf, _pattern(100 + src, MIB // 2)))
        out["any_source"] = seen
    else:
        dist.send(_pattern(100 + rank, MIB // 2), dst=0, tag=9)
    # a receive posted late: the payload is stashed while it streams in
    if rank == 1:
        dist.isend(_pattern(5, 2 * MIB), dst=0, tag=11).wait()
    elif rank == 0:
        time.sleep(0.2)
        buf = np.empty(2 * MIB, np.float32)
        dist.recv(buf, src=1, tag=11)
        out["late_receive"] = bool(np.array_equal(buf, _pattern(5, 2 * MIB)))
    # a wrong buffer fails the receive; the message is skipped and the stream goes on
    if rank == 2:
        dist.send(_pattern(1, MIB // 4), dst=1, tag=12)
        dist.send(_pattern(2, MIB // 4), dst=1, tag=12)
    elif rank == 1:
        try:
            dist.recv(np.empty(MIB // 2, np.float32), src=2, tag=12)
        except BufferMismatchError as exc:
            out["mismatch"] = str(exc)
        buf = np.empty(MIB // 4, np.float32)
        dist.recv(buf, src=2, tag=12)
        out["after_mismatch"] = bool(np.array_equal(buf, _pattern(2, MIB // 4)))
    # batch_isend_irecv around the ring of ranks
    buf = np.empty(MIB, np.float32)
    ops = [dist.P2POp(dist.isend, _pattern(rank, MIB), (rank + 1) % world),
           dist.P2POp(dist.irecv, buf, (rank - 1) % world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["batch"] = bool(np.array_equal(buf, _pattern((rank - 1) % world, MIB)))
    # a TCP-schedule collective moves its chunks through the rings too
    x = np.full(2 * MIB, rank + 1, np.float32)
    dist.all_reduce(x, algorithm="ring")
    out["ring_all_reduce"] = bool((x == sum(range(1, world + 1))).all())
    dist.barrier()
    out["stats"] = _stats()
    return out


def test_every_p2p_api_goes_through_the_rings_and_nothing_is_left(job):
    results = run_processes(_every_api, 3)
    for rank, out in enumerate(results):
        assert out["files_while_running"] == []  # unlinked as soon as both ends mapped them
        assert set(out["stats"]) == {0, 1, 2} - {rank}  # every pair of this host has rings
        checks = {k: v for k, v in out.items() if isinstance(v, bool)}
        assert all(checks.values()), (rank, checks)
    assert len([k for k in results[1] if k.startswith("send_recv")]) == 5
    assert results[0]["any_source"] == {1: True, 2: True}
    assert "2097152 bytes" in results[1]["mismatch"] and "1048576 bytes" in results[1]["mismatch"]
    assert results[2]["tags_reversed"] and results[2]["mixed_order"]
    sent = {rank: out["stats"] for rank, out in enumerate(results)}
    assert sent[0][1][0] >= 68 * MIB  # 64 MiB + 4 MiB + ... from rank 0 to rank 1
    for a in range(3):  # what a sent to b through its ring is what b received from a
        for b in set(range(3)) - {a}:
            assert sent[a][b][0] == sent[b][a][1] > 0


# -- off switches, and a ring much smaller than the messages ----------------------------------

def _exchange(rank, world, n):
    buf = np.empty(n, np.float32)
    peer = 1 - rank
    works = [dist.irecv(buf, src=peer), dist.isend(_pattern(rank, n), dst=peer)]
    for w in works:
        w.wait()
    return bool(np.array_equal(buf, _pattern(peer, n))), _stats()


# (the default, rings on: test_every_p2p_api_goes_through_the_rings_and_nothing_is_left)
@pytest.mark.parametrize("env, rings", [
    ({"CHORUS_SHM_P2P_BYTES": str(256 << 10)}, True),  # 64 MiB through a 256 KiB ring
    ({"CHORUS_SHM_P2P": "0"}, False),
    ({"CHORUS_TRANSPORT": "tcp"}, False),
    ({"CHORUS_HOST_ID": "hostA,hostB"}, False),  # different hosts: never shared memory
])
def test_switches(monkeypatch, job, env, rings):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # with rings off, 4 MiB (above CHORUS_SHM_P2P_MIN, 256 KiB) would have taken them as 64 MiB does
    n = 16 * MIB if rings else MIB
    for ok, stats in run_processes(_exchange, 2, n):
        assert ok
        if rings:
            assert list(stats.values())[0] == (4 * n, 4 * n)
        else:
            assert stats == {}


# -- failures ---------------------------------------------------------------------------------

_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time, numpy as np, chorus as dist
    role, outdir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.group.WORLD.transport.shm_p2p_stats(), "no rings"
    big = np.ones(16 << 20, np.float32)  # 64 MiB
    dist.barrier()
    try:
        if role == "writer-dies":  # rank 0 dies while streaming to rank 1; rank 2 waits on rank 1
            if rank == 0:
                def die():
                    time.sleep(0.3)
                    open(f"{outdir}/killed", "w").write(repr(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                for i in range(1000):
                    dist.send(big, dst=1)
                    if i == 1:  # rank 1 has read the first message whole
                        threading.Thread(target=die, daemon=True).start()
            elif rank == 1:
                while True:
                    dist.recv(big, src=0)
            else:
                dist.recv(np.zeros(1), src=1)
        else:  # "reader-dies": rank 1 stops reading (then the test kills it); rank 0 keeps sending
            if rank == 0:
                while True:
                    dist.send(big, dst=1)
            else:
                dist.recv(big, src=0)
                open(f"{outdir}/stopped", "w").write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
    except dist.PeerLostError as exc:
        stats = dist.group.WORLD.transport.shm_p2p_stats()
        open(f"{outdir}/rank{rank}", "w").write(f"{time.time()!r}\\n{stats}\\n{exc}")
        sys.exit(3)
""")


@contextlib.contextmanager
def _launch(tmp_path, role, world):
    """The ranks of ``role``, killed when the block ends (the store's port held until then)."""
    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT)
    with reserved_port() as port:
        procs = [subprocess.Popen([sys.executable, str(script), role, str(tmp_path)],
                                  env=dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                           RANK=str(r), WORLD_SIZE=str(world)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        try:
            yield procs
        finally:
            for p in procs:
                p.kill()


def _survivor(tmp_path, rank, killed_at, victim):
    when, stats, message = (tmp_path / f"rank{rank}").read_text().split("\n", 2)
    assert float(when) - killed_at < 5.0 and f"rank {victim}" in message, (when, killed_at, message)
    return ast.literal_eval(stats)  # {peer: (bytes sent, received)} through the rings


def test_a_writer_killed_mid_message_makes_the_reader_and_the_others_raise_peer_lost_within_5s(
        tmp_path, job):
    with _launch(tmp_path, "writer-dies", 3) as procs:
        outs = [p.communicate(timeout=90) for p in procs]
    assert procs[0].returncode == -signal.SIGKILL
    killed_at = float((tmp_path / "killed").read_text())
    for rank in (1, 2):
        assert procs[rank].returncode == 3, outs[rank][1]
        stats = _survivor(tmp_path, rank, killed_at, 0)
        if rank == 1:
            assert stats[0][1] >= 64 << 20  # it had been receiving through the ring
    assert not leftovers(job)


def test_a_reader_killed_while_the_writer_waits_for_ring_space_fails_the_send_within_5s(tmp_path, job):
    with _launch(tmp_path, "reader-dies", 2) as procs:
        deadline = time.monotonic() + 60
        while not (tmp_path / "stopped").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # rank 0 is now blocked on a full ring
        killed_at = time.time()
        procs[1].kill()
        out, err = procs[0].communicate(timeout=60)
    assert procs[0].returncode == 3, err
    stats = _survivor(tmp_path, 0, killed_at, 1)
    assert stats[1][0] >= 64 << 20
    assert not leftovers(job)
