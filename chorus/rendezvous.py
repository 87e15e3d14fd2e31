"""Rendezvous: how the ranks of a job find each other and a shared store.

``rendezvous(init_method, rank, world_size, ...)`` turns an init method into a store
plus this process's rank and world size::

    env://                 MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the environment
                           (set by chorusrun / torchrun, or derived from SLURM, Open MPI
                           or MPICH/PMI variables, see ``detect_environment``)
    tcp://HOST:PORT        rank and world size as arguments or ``?rank=R&world_size=W``
    file:///PATH           a FileStore at PATH (shared file system); same arguments
    store=...              an existing store; rank and world size must be given

For env:// and tcp://, rank 0 hosts the TCPStore server on HOST:PORT (bound to that
address only) and every other rank connects to it, unless ``CHORUS_STORE_HOSTED=1``
says a launcher already hosts it: then every rank is a client (for env://, of
MASTER_ADDR:CHORUS_STORE_PORT where chorusrun set it, leaving MASTER_PORT to torch's own
rendezvous).  Connections carry the job token from ``CHORUS_TOKEN`` (see
``chorus.net.get_token``); without one, a job whose ranks all share this host derives one
(``chorus.host.secret``: rank 0 writes it to a file only this user can read once its
store listens, the others read it before they connect).  ``RendezvousInfo.token`` is the
token the job's connections prove, either way.  Every argument is checked before any
connection is made.

Where no launcher says otherwise, ``local_rank`` is ``rank`` and ``local_world_size``
is ``world_size`` (all ranks on one host).

``rendezvous`` returns once every rank has joined through the store (:func:`agree`), and
fails fast, on every rank, when they cannot form one job: ranks started with different
world sizes, or a rank whose job token the store refused.
"""

from __future__ import annotations

import importlib
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import parse_qs, urlsplit

from chorus import config
from chorus.errors import InvalidArgumentError, RendezvousError, StoreTimeoutError
from chorus.host.secret import LocalSecret, job_secret
from chorus.net import get_token
from chorus.store import REFUSALS_KEY, REFUSED_KEY, FileStore, Store, TCPStore

SUPPORTED = "env:// (MASTER_ADDR/MASTER_PORT), tcp://HOST:PORT, file:///PATH"
#: Seconds between two looks at the store's refused connections while waiting at rendezvous.
POLL_S = 1.0
#: Seconds a rendezvous may stay incomplete once a waiting rank has seen that the store refused
#: a connection (at any time: the refused rank often came first) before it gives up; a
#: stranger's attempt must not fail a job whose ranks are about to arrive.
REFUSED_GRACE_S = 4.0
#: Seconds a store stays open after this rank's rendezvous failed: when it hosts the store,
#: the other ranks (those still connecting too) read there why the job cannot start.
LINGER_S = 5.0
ENV_EXAMPLE = "e.g. MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=0 WORLD_SIZE=2"


@dataclass(frozen=True)
class RendezvousInfo:
    """What a rank learns from rendezvous: the shared store and where it stands."""

    store: Store
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    #: the job token the store and transport connections prove: CHORUS_TOKEN, or the
    #: secret derived for a job on one host (``secret``), or None (unauthenticated)
    token: bytes | None = None
    #: the derived secret, if any; rank 0 removes its file with ``secret.release()`` once
    #: every rank has connected: rendezvous itself where rank 0 serves the store, else
    #: (torchrun's agent store) init_process_group, after the transport's set-up
    secret: LocalSecret | None = None


# -- environment detection -------------------------------------------------------------

# For each field, the variables that give it, most specific launcher first: explicit
# torch/chorusrun variables, then Open MPI, then MPICH/PMI, then SLURM (innermost launcher
# first, so that mpirun inside an allocation wins over the allocation's variables).
_FIELDS = {
    "rank": ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"),
    "world_size": ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"),
    "local_rank": ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                   "SLURM_LOCALID"),
    "local_world_size": ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                         "SLURM_NTASKS_PER_NODE"),
}


def _int_var(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value.strip())
    except ValueError:
        raise InvalidArgumentError(
            f"environment variable {name}={value!r} is not an integer; fix or unset it"
        ) from None


def expand_nodelist(nodelist: str) -> Iterator[str]:
    """Yield the host names of a SLURM node list, e.g. "node[03-05,7],gpu1" ->
    node03, node04, node05, node7, gpu1.  Several bracket groups in one name multiply
    ("r[1-2]n[1-2]" -> r1n1, r1n2, r2n1, r2n2); zero padding is kept.
    """
    for name in _split_outside_brackets(nodelist):
        yield from _expand_name(name, nodelist)


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise InvalidArgumentError(f"SLURM node list {text!r} has unbalanced brackets")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise InvalidArgumentError(f"SLURM node list {text!r} has unbalanced brackets")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_name(name: str, whole: str) -> Iterator[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        yield name
        return
    head, tail = name[:match.start()], name[match.end():]
    for item in match.group(1).split(","):
        low, _, high = item.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise InvalidArgumentError(
                f"SLURM node list {whole!r}: cannot read the range {item!r}; expected forms "
                f"like node[1-4,7]"
            )
        width = len(low)
        for number in range(int(low), int(high or low) + 1):
            for rest in _expand_name(tail, whole):
                yield f"{head}{number:0{width}d}{rest}"


def _slurm_local_world_size(environ: Mapping[str, str]) -> int | None:
    """Tasks on this node from SLURM_TASKS_PER_NODE ("2(x3),1") and SLURM_NODEID."""
    spec, node = environ.get("SLURM_TASKS_PER_NODE"), environ.get("SLURM_NODEID")
    if not spec or node is None or not node.isdigit():
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[int(node)] if int(node) < len(counts) else None


def detect_environment(environ: Mapping[str, str] = os.environ) -> dict:
    """Return rank, world_size, local_rank, local_world_size, master_addr, master_port
    (each None when no variable gives it) and ``launcher`` (which one was seen).

    Reads torchrun/chorusrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), Open MPI (OMPI_COMM_WORLD_*), MPICH/PMI (PMI_RANK,
    PMI_SIZE, MPI_LOCALRANKID) and SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
    SLURM_NTASKS_PER_NODE, first host of SLURM_JOB_NODELIST).  Explicit torch variables
    win over the schedulers'.
    """
    info: dict = {}
    for field, names in _FIELDS.items():
        name = next((n for n in names if environ.get(n, "").strip()), None)
        info[field] = None if name is None else _int_var(environ, name)
    if info["local_world_size"] is None and "SLURM_PROCID" in environ:
        info["local_world_size"] = _slurm_local_world_size(environ)
    info["master_addr"] = environ.get("MASTER_ADDR") or None
    if info["master_addr"] is None:
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if nodelist and "SLURM_PROCID" in environ:
            info["master_addr"] = next(expand_nodelist(nodelist), None)
    info["master_port"] = _int_var(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else None
    info["launcher"] = _launcher(environ)
    return info


def _launcher(environ: Mapping[str, str]) -> str | None:
    if config.is_set("CHORUS_JOB_ID", environ):
        return "chorusrun"
    for var, name in (("TORCHELASTIC_RUN_ID", "torchrun"),
                      ("RANK", "env"), ("OMPI_COMM_WORLD_RANK", "openmpi"),
                      ("PMI_RANK", "pmi"), ("SLURM_PROCID", "slurm")):
        if environ.get(var):
            return name
    return None


# -- validation ------------------------------------------------------------------------

def _check_rank(rank: int | None, world_size: int | None, source: str) -> tuple[int, int]:
    """Validate ``rank`` and ``world_size`` found for ``source`` (an init method, or
    "an explicit store"); say where each can be given when it is missing."""
    if source == "env://":
        how = "pass {name}=... or set {var} (" + ENV_EXAMPLE + ")"
    elif source.startswith("an explicit"):
        how = "pass {name}=... to init_process_group"
    else:
        how = "pass {name}=... or add ?rank=R&world_size=W to the init method"
    if world_size is None or world_size < 0:
        raise InvalidArgumentError(
            f"world_size is not set for {source}: "
            + how.format(name="world_size", var="WORLD_SIZE")
        )
    if world_size == 0:
        raise InvalidArgumentError("world_size must be at least 1, got 0")
    if rank is None or rank == -1:
        raise InvalidArgumentError(
            f"rank is not set for {source}: " + how.format(name="rank", var="RANK")
        )
    if not 0 <= rank < world_size:
        raise InvalidArgumentError(
            f"rank {rank} is out of range for world_size {world_size}: ranks are numbered "
            f"0..{world_size - 1}"
        )
    return rank, world_size


def _parse_port(value, what: str, world_size: int) -> int:
    try:
        port = int(str(value).strip())
    except ValueError:
        port = -1
    if not 0 <= port < 65536:
        raise InvalidArgumentError(
            f"{what}={value!r} is not a port number (1..65535), e.g. 29500"
        )
    if port == 0 and world_size > 1:
        raise InvalidArgumentError(
            f"{what}=0 cannot be used with {world_size} ranks: the other ranks would not know "
            f"which port rank 0 picked; choose a port (e.g. 29500), or let chorusrun "
            f"--master-port 0 host the store"
        )
    return port


def _query_int(query: dict, name: str, init_method: str) -> int | None:
    if name not in query:
        return None
    try:
        return int(query[name][-1])
    except ValueError:
        raise InvalidArgumentError(
            f"init_method {init_method!r}: {name}={query[name][-1]!r} is not an integer"
        ) from None


def _pick(explicit: int, *fallbacks: int | None) -> int | None:
    """Return ``explicit`` unless it is the -1 "unset" default, else the first fallback."""
    if explicit is not None and explicit != -1:
        return explicit
    return next((f for f in fallbacks if f is not None), None)


# -- rendezvous ------------------------------------------------------------------------

def rendezvous(init_method: str | None, rank: int = -1, world_size: int = -1,
               timeout: timedelta = timedelta(minutes=10), store: Store | None = None,
               environ: Mapping[str, str] = os.environ) -> RendezvousInfo:
    """Find the other ranks; return the shared store, this rank and the world size.

    Raises InvalidArgumentError for bad or missing arguments (before connecting),
    RendezvousError when the store cannot be hosted or reached or the ranks disagree
    (:func:`agree`), and StoreTimeoutError when the other ranks do not join within
    ``timeout``.
    """
    info = _find_store(init_method, rank, world_size, timeout, store, environ)
    try:
        try:
            agree(info.store, info.rank, info.world_size, timeout.total_seconds())
        finally:
            if info.secret is not None:
                info.secret.release()  # every rank joined (each read the file), or the job failed
    except BaseException:
        close = getattr(info.store, "close", None)
        if store is None and close is not None:
            # not at once: where this rank hosts the store, the others still read why there
            timer = threading.Timer(LINGER_S, close)
            timer.daemon = True
            timer.start()
        raise
    return info


def _find_store(init_method: str | None, rank: int, world_size: int, timeout: timedelta,
                store: Store | None, environ: Mapping[str, str]) -> RendezvousInfo:
    env = detect_environment(environ)
    env["token"] = get_token(config.get("CHORUS_TOKEN", environ))
    if store is not None:
        if init_method is not None:
            raise InvalidArgumentError("pass either init_method or store, not both")
        rank, world_size = _check_rank(_pick(rank), _pick(world_size), "an explicit store")
        return _info(store, rank, world_size, env, None, None)
    url = urlsplit(init_method or "env://")
    query = parse_qs(url.query)
    q_rank = _query_int(query, "rank", init_method)
    q_world = _query_int(query, "world_size", init_method)
    if url.scheme == "env":
        rank, world_size = _check_rank(_pick(rank, q_rank, env["rank"]),
                                       _pick(world_size, q_world, env["world_size"]), "env://")
        host = env["master_addr"]
        if host is None:
            raise InvalidArgumentError(
                f"MASTER_ADDR is not set: env:// needs the address of the host of rank 0 "
                f"({ENV_EXAMPLE}), or use init_method='tcp://HOST:PORT'"
            )
        if env["master_port"] is None:
            raise InvalidArgumentError(
                f"MASTER_PORT is not set: env:// needs the port rank 0 listens on ({ENV_EXAMPLE})"
            )
        port = _parse_port(env["master_port"], "MASTER_PORT", world_size)
        if config.get("CHORUS_STORE_HOSTED", environ):
            port = config.get("CHORUS_STORE_PORT", environ) or port
        if environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            return _torchrun_rendezvous(host, port, rank, world_size, timeout, env, environ)
        return _tcp_rendezvous(host, port, rank, world_size, timeout, env, environ)
    if url.scheme == "tcp":
        rank, world_size = _check_rank(_pick(rank, q_rank), _pick(world_size, q_world),
                                       init_method)
        host, port_text = url.hostname, url.netloc.rpartition(":")[2]
        if not host or ":" not in url.netloc or not port_text:
            raise InvalidArgumentError(
                f"init_method {init_method!r} needs a host and a port, e.g. tcp://10.0.0.1:29500"
            )
        port = _parse_port(port_text, f"the port of {init_method!r}", world_size)
        return _tcp_rendezvous(host, port, rank, world_size, timeout, env, environ)
    if url.scheme == "file":
        rank, world_size = _check_rank(_pick(rank, q_rank), _pick(world_size, q_world),
                                       init_method)
        path = (url.netloc + url.path) if url.netloc not in ("", "localhost") else url.path
        if not path:
            raise InvalidArgumentError(
                f"init_method {init_method!r} names no file, e.g. file:///tmp/chorus_init"
            )
        return _info(FileStore(path, world_size, timeout), rank, world_size, env, None, None)
    raise InvalidArgumentError(
        f"unknown init_method {init_method!r}; supported: {SUPPORTED}"
    )


def _torchrun_rendezvous(host: str, port: int, rank: int, world_size: int, timeout: timedelta,
                         env: dict, environ: Mapping[str, str]) -> RendezvousInfo:
    """Under torchrun, whose agent already serves a (torch) TCPStore on MASTER_PORT: use it,
    through chorus.torch's adapter (torch is there: torchrun is torch's), with keys under
    a prefix of their own per restart of the job."""
    try:
        stores = importlib.import_module("chorus.torch.stores")
    except ImportError as exc:
        raise RendezvousError(f"torchrun's agent serves the store on {host}:{port}, and reaching it needs "
                              f"torch.distributed: {exc}") from None
    restart = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = stores.agent_store(host, port, world_size, timeout, f"chorus/{restart}/")
    # torch's store cannot prove a token, but the transport's connections can: rank 0
    # writes the secret now and removes it once its transport is connected to every rank
    try:
        secret = _derived(env, rank, world_size, host, port, timeout, environ, publish=True,
                          what=f"rank 0 of this torchrun job (the agent's store is {host}:{port})")
    except BaseException:
        store.close()
        raise
    return _info(store, rank, world_size, env, host, port, secret)


def _tcp_rendezvous(host: str, port: int, rank: int, world_size: int, timeout: timedelta,
                    env: dict, environ: Mapping[str, str]) -> RendezvousInfo:
    hosted = config.get("CHORUS_STORE_HOSTED", environ)
    is_master = rank == 0 and not hosted
    # a launcher's store proves the launcher's token or none: no derived secret there
    secret = None if hosted else _derived(env, rank, world_size, host, port, timeout, environ,
                                          publish=False, what=f"{host}:{port}")
    try:
        store = TCPStore(host, port, world_size, is_master=is_master, timeout=timeout,
                         wait_for_workers=False, multi_tenant=True,  # (agree() waits for the ranks)
                         token=env["token"] if secret is None else secret.token)
        if is_master and secret is not None:
            try:  # the port is ours: only now may the file name this job's store
                secret.publish()
            except BaseException:
                store.close()
                raise
    except BaseException:
        if secret is not None:
            secret.release()
        raise
    # (rendezvous() releases the secret once agree() saw every rank join: each read the file)
    return _info(store, rank, world_size, env, host, store.port, secret)


def _derived(env: dict, rank: int, world_size: int, host: str, port: int, timeout: timedelta,
             environ: Mapping[str, str], publish: bool, what: str) -> LocalSecret | None:
    """The secret of a job without a token whose ranks share this host (chorus.host.secret)."""
    if env["token"] is not None:
        return None
    return job_secret(rank, world_size, host, port, timeout.total_seconds(),
                      local_world_size=env["local_world_size"], launcher_world_size=env["world_size"],
                      environ=environ, publish=publish, what=what)


def _info(store: Store, rank: int, world_size: int, env: dict, host: str | None,
          port: int | None, secret: LocalSecret | None = None) -> RendezvousInfo:
    local_rank = env["local_rank"] if env["local_rank"] is not None else rank
    local_size = env["local_world_size"] if env["local_world_size"] is not None else world_size
    token = env["token"] if secret is None else secret.token
    return RendezvousInfo(store, rank, world_size, local_rank, local_size, host, port, token, secret)


# -- agreeing on one job ---------------------------------------------------------------

def agree(store: Store, rank: int, world_size: int, timeout: float) -> None:
    """Return once all ``world_size`` ranks have joined through ``store``; fail fast when
    they cannot form one job.

    Each rank's n-th call on a store meets the other ranks' n-th.  Every rank writes the
    world size it was given; the first written is the job's.  A rank given another one
    fails at once, and marks the round failed, which fails every rank waiting in it.  The
    last rank to join marks it complete.  While waiting, a rank looks every POLL_S seconds
    at the connections the store refused at the handshake (``chorus.store.REFUSED_KEY``);
    if there was one (before this round, too: the refused rank may have come first) and
    the round is still incomplete REFUSED_GRACE_S after the rank saw it, the rank gives
    up, naming it: a rank started with another token never joins.
    """
    round_no = store.add(f"chorus/rdzv/rounds/{rank}", 1)
    prefix = f"chorus/rdzv/{round_no}/"
    claim = f"{world_size} {rank}".encode()
    first = store.compare_set(prefix + "world_size", b"", claim)
    if first != claim:
        size, _, who = first.decode().partition(" ")
        if int(size) != world_size:
            why = f"rank {rank} says world_size {world_size}, rank {who} says {size}"
            store.set(prefix + "verdict", why)
            raise RendezvousError(_mismatch_message(why))
    store.set(f"{prefix}rank/{rank}", b"")
    if store.add(prefix + "joined", 1) == world_size:
        store.set(prefix + "verdict", "ok")
    verdict = _wait_for_verdict(store, prefix, world_size, timeout)
    if verdict != b"ok":
        raise RendezvousError(_mismatch_message(verdict.decode()))


def _wait_for_verdict(store: Store, prefix: str, world_size: int, timeout: float) -> bytes:
    start = time.monotonic()
    # Only chorus's store server notes refused connections; a store of torch's (under torchrun)
    # would also log every short wait that timed out.
    watch = isinstance(store, TCPStore)
    refused_at = None
    while True:
        left = timeout - (time.monotonic() - start)
        try:
            return store.get(prefix + "verdict", timeout=max(0.001, min(POLL_S, left) if watch else left))
        except StoreTimeoutError:
            pass
        now = time.monotonic()
        if watch and refused_at is None and store.add(REFUSALS_KEY, 0):
            refused_at = now
        if refused_at is not None and now - refused_at >= REFUSED_GRACE_S:
            raise RendezvousError(
                f"rendezvous: {_joined(store, prefix)} of {world_size} ranks joined, and the store "
                f"refused {store.get(REFUSED_KEY).decode(errors='replace')}. A rank whose job token "
                f"differs never joins: give every rank the same CHORUS_TOKEN (chorusrun: the same "
                f"--token on every node)")
        if now - start >= timeout:
            missing = [r for r in range(world_size) if not store.check([f"{prefix}rank/{r}"])]
            raise StoreTimeoutError(
                f"rendezvous: Timed out after {timeout:g} s: only {_joined(store, prefix)} of {world_size} "
                f"ranks joined (missing: ranks {missing}); start every rank, check that they use the same "
                f"MASTER_ADDR/MASTER_PORT, or pass a longer timeout")


def _joined(store: Store, prefix: str) -> int:
    return store.add(prefix + "joined", 0)


def _mismatch_message(why: str) -> str:
    return (f"rendezvous: the ranks disagree on the size of the job: {why}. Start every rank "
            f"with the same WORLD_SIZE (chorusrun: the same --nnodes and --nproc-per-node on "
            f"every node)")
