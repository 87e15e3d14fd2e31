"""Rendezvous: environment detection, every init method with 4 ranks as threads, errors."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import pytest
from proc_support import held_port

from chorus import net
from chorus.errors import (
    AuthenticationError,
    InvalidArgumentError,
    RendezvousError,
)
from chorus.rendezvous import RendezvousInfo, detect_environment, expand_nodelist, rendezvous
from chorus.store import HashStore, TCPStoreServer

TIMEOUT = timedelta(seconds=10)


def run_ranks(world: int, make_info) -> list[RendezvousInfo]:
    """Run ``make_info(rank)`` in ``world`` threads; each rank writes its key and reads all
    the others'.  Return the infos (stores still open), ordered by rank."""
    infos: list = [None] * world
    errors: list = []

    def rank_main(rank: int) -> None:
        try:
            info = make_info(rank)
            info.store.set(f"hello/{rank}", f"from {rank}")
            values = info.store.multi_get([f"hello/{r}" for r in range(world)])
            assert values == [f"from {r}".encode() for r in range(world)]
            assert info.store.add("arrived", 1) <= world
            infos[rank] = info
        except BaseException as e:
            errors.append((rank, e))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert infos[0].store.get("arrived") == str(world).encode()
    return infos


def close_all(infos: list[RendezvousInfo]) -> None:
    for info in reversed(infos):  # rank 0 (which may host the server) last
        info.store.close()


# -- environment detection -------------------------------------------------------------

def test_detect_torchrun():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
    assert detect_environment(env) == {
        "rank": 3, "world_size": 8, "local_rank": 1, "local_world_size": 2,
        "master_addr": "10.1.2.3", "master_port": 29500, "launcher": "torchrun"}


def test_detect_chorusrun():
    env = {"RANK": "0", "WORLD_SIZE": "1", "CHORUS_JOB_ID": "abc", "TORCHELASTIC_RUN_ID": "abc"}
    assert detect_environment(env)["launcher"] == "chorusrun"


def test_detect_nothing():
    assert detect_environment({}) == {
        "rank": None, "world_size": None, "local_rank": None, "local_world_size": None,
        "master_addr": None, "master_port": None, "launcher": None}


SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
         "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "node[03-05,7],gpu1",
         "SLURM_NODEID": "1"}


def test_detect_slurm():
    assert detect_environment(SLURM) == {
        "rank": 5, "world_size": 8, "local_rank": 1, "local_world_size": 4,
        "master_addr": "node03", "master_port": None, "launcher": "slurm"}


def test_detect_slurm_uneven_tasks_per_node():
    env = dict(SLURM, SLURM_TASKS_PER_NODE="2(x3),1", SLURM_NODEID="3")
    del env["SLURM_NTASKS_PER_NODE"]
    assert detect_environment(env)["local_world_size"] == 1
    env["SLURM_NODEID"] = "1"
    assert detect_environment(env)["local_world_size"] == 2


def test_torch_variables_win_over_slurm():
    env = dict(SLURM, RANK="2", WORLD_SIZE="4", MASTER_ADDR="head", MASTER_PORT="1234")
    info = detect_environment(env)
    assert (info["rank"], info["world_size"]) == (2, 4)
    assert (info["master_addr"], info["master_port"]) == ("head", 1234)
    assert info["local_rank"] == 1  # not given by torch variables: SLURM's


def test_detect_open_mpi():
    env = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "12",
           "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    info = detect_environment(env)
    assert (info["rank"], info["world_size"], info["local_rank"], info["local_world_size"]) == (
        6, 12, 2, 4)
    assert info["launcher"] == "openmpi" and info["master_addr"] is None


def test_detect_mpich_pmi():
    env = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
    info = detect_environment(env)
    assert (info["rank"], info["world_size"], info["local_rank"], info["local_world_size"]) == (
        1, 3, 1, 3)
    assert info["launcher"] == "pmi"


def test_mpirun_inside_a_slurm_allocation_uses_mpi_ranks():
    env = {"SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n1", "OMPI_COMM_WORLD_RANK": "3",
           "OMPI_COMM_WORLD_SIZE": "4"}
    info = detect_environment(env)
    assert (info["rank"], info["world_size"]) == (3, 4)
    assert info["master_addr"] is None  # no SLURM_PROCID: not an srun task


def test_bad_integer_variable_is_named():
    with pytest.raises(InvalidArgumentError, match="WORLD_SIZE='four' is not an integer"):
        detect_environment({"RANK": "0", "WORLD_SIZE": "four"})


@pytest.mark.parametrize("nodelist,hosts", [
    ("node[03-05,7],gpu1", ["node03", "node04", "node05", "node7", "gpu1"]),
    ("single", ["single"]),
    ("a,b,c", ["a", "b", "c"]),
    ("gpu[001-003]", ["gpu001", "gpu002", "gpu003"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("rack1-[9-10].cluster", ["rack1-9.cluster", "rack1-10.cluster"]),
    ("x[5]", ["x5"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert list(expand_nodelist(nodelist)) == hosts


@pytest.mark.parametrize("nodelist,message", [
    ("node[1-3", "unbalanced brackets"),
    ("node]1[", "unbalanced brackets"),
    ("node[a-b]", "cannot read the range 'a-b'"),
])
def test_expand_nodelist_errors(nodelist, message):
    with pytest.raises(InvalidArgumentError, match=message):
        list(expand_nodelist(nodelist))


# -- every init method, 4 ranks as threads ---------------------------------------------

def test_env_rendezvous_four_ranks():
    port = held_port()
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "4", "CHORUS_TOKEN": "rdzv-token"}
    infos = run_ranks(4, lambda r: rendezvous(
        None, timeout=TIMEOUT, environ=dict(base, RANK=str(r), LOCAL_RANK=str(r))))
    try:
        for r, info in enumerate(infos):
            assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (
                r, 4, r, 4)
            assert (info.master_addr, info.master_port) == ("127.0.0.1", port)
    finally:
        close_all(infos)


def test_tcp_rendezvous_four_ranks_with_query_or_arguments():
    port = held_port()

    def make(rank):
        if rank % 2:
            return rendezvous(f"tcp://127.0.0.1:{port}?rank={rank}&world_size=4",
                              timeout=TIMEOUT, environ={})
        return rendezvous(f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                          timeout=TIMEOUT, environ={})

    infos = run_ranks(4, make)
    try:
        assert [i.rank for i in infos] == [0, 1, 2, 3]
        assert all(i.master_port == port and i.local_world_size == 4 for i in infos)
    finally:
        close_all(infos)


def test_file_rendezvous_four_ranks(tmp_path):
    path = tmp_path / "rdzv"
    infos = run_ranks(4, lambda r: rendezvous(f"file://{path}", rank=r, world_size=4,
                                              timeout=TIMEOUT, environ={}))
    assert path.exists()
    assert [i.rank for i in infos] == [0, 1, 2, 3]
    assert infos[2].master_addr is None and infos[2].master_port is None
    close_all(infos)
    assert not path.exists()  # removed once all world_size ranks closed it


def test_explicit_store_is_used_as_is():
    store = HashStore()
    infos = run_ranks(4, lambda r: rendezvous(None, rank=r, world_size=4, store=store,
                                              environ={}))
    assert all(i.store is store for i in infos)
    assert [(i.rank, i.local_rank, i.world_size) for i in infos] == [
        (0, 0, 4), (1, 1, 4), (2, 2, 4), (3, 3, 4)]


def test_launcher_hosted_store_makes_every_rank_a_client():
    server = TCPStoreServer("127.0.0.1", 0, token="hosted")
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "WORLD_SIZE": "4",
            "CHORUS_STORE_HOSTED": "1", "CHORUS_TOKEN": "hosted"}
    try:
        infos = run_ranks(4, lambda r: rendezvous("env://", timeout=TIMEOUT,
                                                  environ=dict(base, RANK=str(r))))
    finally:
        server.close()
    # rank 0 did not host anything: with the launcher's server gone, its store is cut off
    with pytest.raises(RendezvousError, match="lost the connection"):
        infos[0].store.set("after", b"x")
    close_all(infos)


def test_wrong_token_against_a_hosted_store():
    server = TCPStoreServer("127.0.0.1", 0, token="right")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "WORLD_SIZE": "2",
           "RANK": "1", "CHORUS_STORE_HOSTED": "1", "CHORUS_TOKEN": "wrong"}
    try:
        with pytest.raises(AuthenticationError, match="different job token"):
            rendezvous(None, timeout=TIMEOUT, environ=env)
    finally:
        server.close()


def test_single_rank_env_with_port_zero():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "1"}
    info = rendezvous(None, timeout=TIMEOUT, environ=env)
    try:
        assert info.master_port > 0
        info.store.set("k", b"v")
        assert info.store.get("k") == b"v"
    finally:
        info.store.close()


# -- bad input: every message checked ---------------------------------------------------

ENV = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"}


@pytest.mark.parametrize("init_method,kwargs,environ,message", [
    ("tcp://127.0.0.1:29500", {"rank": 4, "world_size": 4}, {},
     "rank 4 is out of range for world_size 4: ranks are numbered 0..3"),
    (None, {}, dict(ENV, RANK="-3"), "rank -3 is out of range for world_size 2"),
    ("tcp://127.0.0.1:29500", {"rank": 0, "world_size": 0}, {},
     "world_size must be at least 1, got 0"),
    (None, {}, {k: v for k, v in ENV.items() if k != "WORLD_SIZE"},
     "world_size is not set for env://: pass world_size=... or set WORLD_SIZE"),
    (None, {}, {k: v for k, v in ENV.items() if k != "RANK"},
     "rank is not set for env://: pass rank=... or set RANK"),
    ("tcp://127.0.0.1:29500", {"world_size": 2}, {},
     "rank is not set for tcp://127.0.0.1:29500: pass rank=... or add "
     "?rank=R&world_size=W to the init method"),
    ("mpi://somewhere", {"rank": 0, "world_size": 1}, {},
     "unknown init_method 'mpi://somewhere'; supported: env:// (MASTER_ADDR/MASTER_PORT), "
     "tcp://HOST:PORT, file:///PATH"),
    (None, {}, {k: v for k, v in ENV.items() if k != "MASTER_ADDR"},
     "MASTER_ADDR is not set: env:// needs the address of the host of rank 0 "
     "(e.g. MASTER_ADDR=127.0.0.1 MASTER_PORT=29500"),
    (None, {}, {k: v for k, v in ENV.items() if k != "MASTER_PORT"},
     "MASTER_PORT is not set: env:// needs the port rank 0 listens on (e.g. MASTER_ADDR="),
    (None, {}, dict(ENV, MASTER_PORT="70000"), "MASTER_PORT=70000 is not a port number"),
    (None, {}, dict(ENV, MASTER_PORT="http"),
     "environment variable MASTER_PORT='http' is not an integer"),
    (None, {}, dict(ENV, MASTER_PORT="0"),
     "MASTER_PORT=0 cannot be used with 2 ranks"),
    ("tcp://127.0.0.1:port", {"rank": 0, "world_size": 1}, {},
     "the port of 'tcp://127.0.0.1:port'='port' is not a port number"),
    ("tcp://127.0.0.1", {"rank": 0, "world_size": 1}, {},
     "needs a host and a port, e.g. tcp://10.0.0.1:29500"),
    ("tcp://127.0.0.1:1?rank=one&world_size=2", {}, {},
     "rank='one' is not an integer"),
    ("file://", {"rank": 0, "world_size": 1}, {}, "names no file, e.g. file:///tmp/chorus_init"),
])
def test_bad_input_is_rejected_before_connecting(init_method, kwargs, environ, message):
    start = time.monotonic()
    with pytest.raises(InvalidArgumentError) as info:
        rendezvous(init_method, timeout=TIMEOUT, environ=environ, **kwargs)
    assert message in str(info.value)
    assert time.monotonic() - start < 1  # no connection attempt
    assert isinstance(info.value, ValueError)


def test_store_and_init_method_together():
    with pytest.raises(InvalidArgumentError, match="either init_method or store, not both"):
        rendezvous("env://", rank=0, world_size=1, store=HashStore(), environ={})


def test_store_without_rank_or_world_size():
    with pytest.raises(InvalidArgumentError, match="rank is not set for an explicit store"):
        rendezvous(None, world_size=2, store=HashStore(), environ={})
    with pytest.raises(InvalidArgumentError, match="world_size is not set for an explicit store"):
        rendezvous(None, rank=0, store=HashStore(), environ={})


def test_address_in_use():
    with net.listen("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        env = dict(ENV, MASTER_PORT=str(port), WORLD_SIZE="1")
        with pytest.raises(RendezvousError) as info:
            rendezvous(None, timeout=TIMEOUT, environ=env)
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "--master-port 0" in message


def test_non_master_gives_up_when_nobody_hosts():
    port = held_port()
    env = dict(ENV, MASTER_PORT=str(port), RANK="1")
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=f"could not connect to 127.0.0.1:{port}"):
        rendezvous(None, timeout=timedelta(seconds=0.3), environ=env)
    assert time.monotonic() - start < 3



# -- ranks that cannot form one job fail fast, every one ---------------------------------------

def fail_each(world: int, make_info) -> dict[int, tuple[BaseException, float]]:
    """Run ``make_info(rank)`` in ``world`` threads, each expected to raise; return each
    rank's error and the seconds it took."""
    errors: dict = {}

    def rank_main(rank: int) -> None:
        start = time.monotonic()
        try:
            make_info(rank).store.close()
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            errors[rank] = (e, time.monotonic() - start)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(errors) == list(range(world))
    return errors


@pytest.mark.parametrize("sizes", [(2, 3), (3, 2)])
def test_a_world_size_mismatch_fails_every_rank_naming_both_sizes(sizes):
    port = held_port()
    errors = fail_each(2, lambda r: rendezvous(f"tcp://127.0.0.1:{port}", rank=r, world_size=sizes[r],
                                               timeout=timedelta(seconds=600), environ={}))
    for error, seconds in errors.values():
        assert isinstance(error, RendezvousError) and seconds < 5
        assert re.search(rf"rank (0 says world_size {sizes[0]}, rank 1 says {sizes[1]}"
                         rf"|1 says world_size {sizes[1]}, rank 0 says {sizes[0]})\. Start every rank with "
                         rf"the same WORLD_SIZE", str(error)), error


def test_a_token_mismatch_fails_every_rank_naming_the_token():
    port = held_port()
    tokens = ["ours", "another"]
    errors = fail_each(2, lambda r: rendezvous(None, timeout=timedelta(seconds=600), environ={
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r), "WORLD_SIZE": "2",
        "CHORUS_TOKEN": tokens[r]}))
    (host_error, host_s), (client_error, client_s) = errors[0], errors[1]
    assert isinstance(client_error, AuthenticationError) and client_s < 5
    assert "the server proved a different job token" in str(client_error)
    assert isinstance(host_error, RendezvousError) and host_s < 10
    assert re.search(r"1 of 2 ranks joined, and the store refused a connection from 127\.0\.0\.1:\d+: .*token.*"
                     r"give every rank the same CHORUS_TOKEN", str(host_error)), host_error

