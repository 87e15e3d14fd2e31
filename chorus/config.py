"""Every ``CHORUS_*`` environment variable, declared once: its type, default, valid range
and meaning.

Code reads a setting with ``get(name)`` when it creates a group, a transport or a
connection (never as an import-time constant), so that a value set after ``import
chorus`` counts and tests can change it with ``override``::

    from chorus import config
    limit = config.get("CHORUS_HEARTBEAT_TIMEOUT")      # 20.0 unless set
    with config.override(CHORUS_SHM_ONESHOT_BYTES=1024):  # tests
        ...

A value is looked up in the overrides first, then in the environment (``os.environ``,
or the mapping passed as ``environ``), then the default.  An empty value counts as
unset.  A value chorus cannot use raises ``ConfigError`` naming the variable, the value,
what is valid and the default.  ``python -m chorus.config`` (or ``chorus config``)
prints the effective settings.

This module imports only the standard library and ``chorus.errors`` (it is the layer
just above them), so every other layer may read its settings here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from chorus.errors import InvalidArgumentError

KINDS = ("int", "float", "bool", "str", "choice", "list")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


class ConfigError(InvalidArgumentError):
    """A ``CHORUS_*`` setting has a value chorus cannot use (the message names the
    variable, the value, what is valid and the default), or a name is not declared."""


class UnknownSettingError(ConfigError, KeyError):
    """``get``/``override`` of a name that ``SETTINGS`` does not declare."""

    __str__ = Exception.__str__  # KeyError would quote the whole message


@dataclass(frozen=True)
class Setting:
    """One ``CHORUS_*`` variable.

    ``kind`` says how its text is read: ``int`` and ``float`` (within ``minimum`` and
    ``maximum`` where given), ``bool`` (1/0, true/false, yes/no, on/off), ``str`` (as
    given), ``choice`` (one of ``choices``, any case) or ``list`` (comma-separated
    non-empty items, as a tuple).  ``default`` is the value when unset; None means "not
    set": the code reading it decides (``meaning`` says how).  ``unit`` names what an
    int or float counts, for messages.  ``secret`` values are not printed.
    """

    name: str
    kind: str
    default: object = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    meaning: str = ""
    unit: str = ""
    secret: bool = False

    def __post_init__(self) -> None:
        if not self.name.startswith("CHORUS_") or self.kind not in KINDS:
            raise ValueError(f"setting {self.name!r} of kind {self.kind!r}: the name must start "
                             f"with CHORUS_ and the kind be one of {', '.join(KINDS)}")
        if (self.kind == "choice") != bool(self.choices):
            raise ValueError(f"setting {self.name}: a choice needs choices, other kinds none")

    def parse(self, text: str) -> object:
        """The value that ``text`` (a variable's value) gives; ConfigError if it is not
        valid.  Blank text means unset: the default."""
        stripped = text.strip()
        if not stripped:
            return self.default
        if self.kind == "str":
            return text
        if self.kind == "list":
            items = tuple(item.strip() for item in stripped.split(","))
            if not all(items):
                raise self.error(text)
            return items
        if self.kind == "bool":
            word = stripped.lower()
            if word not in TRUE_WORDS + FALSE_WORDS:
                raise self.error(text)
            return word in TRUE_WORDS
        if self.kind == "choice":
            word = stripped.lower()
            if word not in self.choices:
                raise self.error(text)
            return word
        try:
            value = int(stripped) if self.kind == "int" else float(stripped)
        except ValueError:
            raise self.error(text) from None
        if math.isnan(value) or (self.minimum is not None and value < self.minimum) or (
                self.maximum is not None and value > self.maximum):
            raise self.error(text)
        return value

    def valid(self) -> str:
        """What a valid value looks like, for messages and ``--help``."""
        if self.kind == "bool":
            return "1/0, true/false, yes/no or on/off"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "list":
            return "one name or comma-separated names, none empty"
        if self.kind == "str":
            return "any text"
        what = ("a whole number" if self.kind == "int" else "a number") + (f" of {self.unit}" if self.unit else "")
        low, high = (None if b is None else _number(b) for b in (self.minimum, self.maximum))
        if low is not None and high is not None:
            return f"{what} from {low} to {high}"
        if low is not None:
            return f"{what} >= {low}"
        if high is not None:
            return f"{what} <= {high}"
        return what

    def error(self, text: str) -> ConfigError:
        """The ConfigError for value ``text`` of this setting."""
        return ConfigError(f"{self.name}={text!r}: give {self.valid()} ({self.describe_default()})")

    def describe_default(self) -> str:
        if self.default is None:
            return "unset by default"
        return f"default {format_value(self.default)}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def format_value(value: object) -> str:
    """A value as a user would write it in the environment."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, float):
        return _number(value)
    return str(value)


def _declare(*settings: Setting) -> dict[str, Setting]:
    table: dict[str, Setting] = {}
    for setting in settings:
        if setting.name in table:
            raise ValueError(f"{setting.name} is declared twice")
        table[setting.name] = setting
    return table


#: Each collective's algorithms (``chorus.schedules.registry.ALGORITHMS``; chorus.selection
#: checks the name) and whether ``hierarchical`` (chorus.api.hierarchy) applies.
_ALGORITHMS = {
    "ALL_REDUCE": "ring, recursive_doubling, rabenseifner, two_shot or hierarchical",
    "REDUCE": "binomial or hierarchical",
    "BROADCAST": "binomial, chain or hierarchical",
    "ALL_GATHER": "ring, bruck or hierarchical",
    "GATHER": "binomial",
    "SCATTER": "binomial",
    "REDUCE_SCATTER": "ring, pairwise or hierarchical",
    "ALL_TO_ALL": "pairwise, bruck or linear",
    "BARRIER": "dissemination or hierarchical",
}

SETTINGS: dict[str, Setting] = _declare(
    # -- the job ---------------------------------------------------------------------
    Setting("CHORUS_TOKEN", "str", secret=True,
            meaning="job token every connection proves (HMAC) before it is trusted; chorusrun and "
                    "spawn set one per job; unset: a job on one host derives one "
                    "(CHORUS_LOCAL_SECRET), other jobs are not authenticated"),
    Setting("CHORUS_LOCAL_SECRET", "choice", "auto", choices=("auto", "off"),
            meaning="auto = a job without a token whose ranks all share this host (MASTER_ADDR is a "
                    "loopback address, or LOCAL_WORLD_SIZE equals WORLD_SIZE) authenticates with a "
                    "secret rank 0 writes to a file only this user can read (chorus.host.secret); "
                    "off = such jobs run without a token"),
    Setting("CHORUS_LOCAL_SECRET_DIR", "str",
            meaning="the private directory (yours, mode 0700) of those secret files; unset: "
                    "$XDG_RUNTIME_DIR/chorus, else /tmp/chorus-<uid>"),
    Setting("CHORUS_OBJECT_PICKLE", "choice", "auto", choices=("auto", "safe", "full"),
            meaning="how object collectives unpickle what peers send: auto = only allow-listed globals "
                    "(containers, scalars, numpy, torch tensors, chorus.add_safe_globals) when the job has "
                    "no token, any pickle with one; safe = always only allow-listed; full = any pickle "
                    "(runs whatever code the bytes name)"),
    Setting("CHORUS_JOB_ID", "str",
            meaning="job id (set by chorusrun and spawn); names the job's shared-memory segments "
                    "and tells rendezvous that chorusrun launched the rank; unset: 'nojob'"),
    Setting("CHORUS_STORE_HOSTED", "bool", False,
            meaning="a launcher hosts the TCPStore (chorusrun sets 1): every rank, rank 0 "
                    "included, connects to it as a client"),
    Setting("CHORUS_STORE_PORT", "int", minimum=1, maximum=65535,
            meaning="port of the store a launcher hosts on MASTER_ADDR (chorusrun sets it, and "
                    "leaves MASTER_PORT to torch.distributed's own env:// rendezvous); unset: "
                    "MASTER_PORT"),
    Setting("CHORUS_SOCKET_HOST", "str",
            meaning="address this rank's TCP transport listens on and gives its peers; unset: "
                    "the local address that reaches MASTER_ADDR (127.0.0.1 on one host)"),
    Setting("CHORUS_HEARTBEAT_TIMEOUT", "float", 20.0, minimum=1.0, unit="seconds",
            meaning="a peer that sends nothing for this long is declared lost (heartbeats go "
                    "every second, so at least 1); a payload still arriving counts as heard"),
    Setting("CHORUS_WAIT_REPORT_S", "float", 30.0, minimum=0.0, unit="seconds",
            meaning="an op that has waited this long logs which ranks it waits for (those whose "
                    "data has not arrived, or that have not reached the shared-memory window), "
                    "the op and its number, the group and the time waited, and again after each "
                    "further interval; at most one line per interval per group; 0: never"),
    Setting("CHORUS_SEND_MODE", "choice", "buffered", choices=("buffered", "rendezvous"),
            meaning="buffered: a send returns once its data is on its way, whether or not the "
                    "receiver has posted its receive; rendezvous: a send (and an isend's wait) "
                    "returns only once the matching receive is posted, as torch's blocking sends "
                    "do, and ranks that wait in sends to each other get DeadlockError"),
    # -- limits: what a peer or a stranger may make this process hold -------------------
    Setting("CHORUS_MAX_MESSAGE_BYTES", "int", minimum=1, unit="bytes",
            meaning="the most payload one frame from a peer may claim when it must be buffered "
                    "(no receive posted) or skipped (it does not fit the receive); a frame "
                    "claiming more is refused before anything is allocated and its sender is "
                    "disconnected, so every rank fails; unset: this host's physical memory"),
    Setting("CHORUS_HANDSHAKE_TIMEOUT", "float", 10.0, minimum=0.1, unit="seconds",
            meaning="an incoming transport or store connection must finish its whole handshake "
                    "(token proof; for the transport HELLO and shared-memory offer too) within this "
                    "time, or it is closed"),
    Setting("CHORUS_MAX_PENDING_CONNECTIONS", "int", 64, minimum=1, unit="connections",
            meaning="incoming connections a rank's transport (and a store server) handshakes at "
                    "once, and at most an eighth of the open-file limit; with no room the oldest "
                    "that sent nothing for 0.25 s is shed, else the next waits in the listen "
                    "backlog (a flood costs no more)"),
    Setting("CHORUS_STORE_MAX_VALUE_BYTES", "int", 1 * MIB, minimum=0, unit="bytes",
            meaning="the largest value (and, plus 64 KiB for keys, request) the store accepts "
                    "from a client that did not prove the job token; larger ones get an error"),
    Setting("CHORUS_STORE_MAX_BYTES", "int", 64 * MIB, minimum=0, unit="bytes",
            meaning="clients that did not prove the job token may not grow the store's keys and "
                    "values beyond this many bytes in all; such writes get an error"),
    # -- algorithms ------------------------------------------------------------------
    *(Setting(f"CHORUS_ALGO_{name}", "str",
              meaning=f"{name.lower()}'s algorithm unless algorithm= is passed: {names}; unset: "
                      "chosen by size (chorus.selection), shared memory inside a host")
      for name, names in _ALGORITHMS.items()),
    Setting("CHORUS_SEGMENT_BYTES", "int", 1 * MIB, minimum=1, unit="bytes",
            meaning="pipelining unit of the ring and chain algorithms (unset: a ring all_reduce of "
                    "16 or more ranks sends whole chunks); set it on every rank or on none"),
    Setting("CHORUS_HIER_RING_BYTES", "int", 1 * MIB, minimum=0, unit="bytes",
            meaning="an all_reduce of at least this many bytes per rank, on a group that spans hosts "
                    "of at most two consecutive ranks, runs the flat ring through the hosts instead of the "
                    "hierarchy's three phases (chorus.components.hierarchy); 0: never; must be equal "
                    "on every rank"),
    Setting("CHORUS_TCP_LANE_BYTES", "int", 64 * KIB, minimum=0, maximum=16 * MIB, unit="bytes",
            meaning="a synchronous all_reduce of up to this many bytes per rank, on a group whose "
                    "collectives run over TCP (no shared-memory window), runs from a plan cached per "
                    "dtype, shape and op (same algorithm and bits as the general path); 0: never"),
    Setting("CHORUS_TCP_CHANNELS", "int", 0, minimum=0, maximum=8,
            meaning="sockets per pair of ranks for a large all_reduce over TCP (chorus.components."
                    "channels); 0: as many as this rank's CPUs allow (its usable CPUs over the "
                    "job's ranks on its host), at most 4; the job uses the least any rank asks "
                    "for; 1: one (no channels)"),
    Setting("CHORUS_TCP_CHANNEL_BYTES", "int", 4 * MIB, minimum=1, unit="bytes",
            meaning="an all_reduce of n >= this many bytes per rank (and more than every rank's "
                    "CHORUS_TCP_LANE_BYTES) runs in min(channels, max(2, n // this)) parts, one per "
                    "channel; the job uses the largest any rank gives"),
    Setting("CHORUS_TCP_SPIN_US", "float", minimum=0, unit="microseconds",
            meaning="how long a rank waiting for a small TCP message polls its socket before it "
                    "sleeps in poll(); unset: 200 where every rank of the host has a core of its "
                    "own (LOCAL_WORLD_SIZE, else the job's size, against this process's CPUs), else 0"),
    Setting("CHORUS_TRANSPORT", "choice", "auto", choices=("auto", "shm", "tcp"),
            meaning="auto: shared memory among ranks of one host, TCP between hosts (hierarchy); "
                    "shm: require shared memory (error where impossible); tcp: sockets only"),
    # -- shared memory: the window of a group's collectives --------------------------------
    Setting("CHORUS_HOST_ID", "list",
            meaning="pretend host ids (tests): one for this process, or one per global rank, "
                    "e.g. a,a,b,b; unset: detected (boot id and /dev/shm)"),
    Setting("CHORUS_CUDA_WORKSPACE_BYTES", "int", 64 * MIB, minimum=MIB, maximum=4 * GIB, unit="bytes",
            meaning="GPU memory of each rank's CUDA workspace per group (chorus.cuda): half "
                    "collective slots, half point-to-point channels"),
    Setting("CHORUS_CUDA_FAST_LAUNCH", "bool", True,
            meaning="launch the CUDA kernels through their cached launchers (0: Triton's own call "
                    "path each time; a diagnostic)"),
    Setting("CHORUS_CUDA_DIRECT_LAUNCH", "bool", True,
            meaning="cached launches go straight to cuLaunchKernel with a parameter block laid out once "
                    "per compiled kernel (chorus.cuda.direct), where the kernel allows (0: Triton's "
                    "launcher object; a diagnostic)"),
    Setting("CHORUS_CUDA_REPLAY", "bool", True,
            meaning="an eager all_reduce repeated on the same tensor replays a one-kernel CUDA graph "
                    "captured for it (cuGraphLaunch: a third of cuLaunchKernel's CPU time), its epoch "
                    "read on the device (chorus.cuda.replays; 0: a kernel launch each call)"),
    Setting("CHORUS_CUDA_HINTS", "bool", True,
            meaning="vectorisation hints in the fused all_reduce kernels (0: none; a diagnostic for a "
                    "compiler that refuses them)"),
    Setting("CHORUS_BENCH_CUDA_DRY", "bool", False,
            meaning="chorus bench --device cuda on CPU tensors, with gloo standing in for NCCL (tests)"),
    Setting("CHORUS_BENCH_VERBOSE", "bool", False,
            meaning="chorus bench --device cuda prints each rank's progress"),
    Setting("CHORUS_CUDA_FUSED_WARPS", "int", 4, minimum=1, maximum=16, unit="warps",
            meaning="warps a block of the fused all_reduce kernels (chorus.cuda.fused): each thread "
                    "moves 8 elements a step; raised to a thread per rank for groups over 32"),
    Setting("CHORUS_CUDA_TWO_SHOT_PER_THREAD", "int", 0, minimum=0, maximum=128, unit="elements",
            meaning="elements each thread of a two-shot all_reduce block moves a step (a power of two; "
                    "more keeps more loads in flight over the links); 0: by size, 8 below 4 MiB, "
                    "16 to 64 MiB and 32 from there (chorus.cuda.algorithms)"),
    Setting("CHORUS_CUDA_FUSED_BLOCKS", "int", 128, minimum=1, maximum=128, unit="blocks",
            meaning="most blocks of a fused all_reduce kernel (each meets the same block of the peers)"),
    Setting("CHORUS_CUDA_RAILS", "choice", "auto", choices=("auto", "nccl", "tcp", "off"),
            meaning="CUDA groups spanning hosts (chorus.cuda.rails): chorus's kernels inside each host and, "
                    "between hosts, one NCCL communicator per rail (nccl), a chorus sub-group staged through "
                    "pinned host memory over TCP (tcp), or every call staged (off); auto: nccl where torch "
                    "has NCCL"),
    Setting("CHORUS_CUDA_RAILS_ALL_REDUCE", "choice", "flat", choices=("flat", "rails"),
            meaning="all_reduce of CUDA tensors in a group spanning hosts with NCCL rails "
                    "(chorus.cuda.rails): flat: one NCCL all_reduce over the whole group; rails: "
                    "reduce_scatter in each host, all_reduce on each rail, all_gather in each host.  On two "
                    "simulated hosts of 2 H200s flat took 0.58-0.80x the rails' time at every size measured, "
                    "64 KiB to 1 GiB (docs/results/4xh200/rails-flat/)"),
    Setting("CHORUS_CUDA_NCCL_FROM_BYTES", "int", 16 * MIB, minimum=0, unit="bytes",
            meaning="all_reduce of CUDA tensors inside a host runs on NCCL's kernels from this size on, "
                    "or from the most one two-shot round of the workspace holds where that is smaller "
                    "(13.9 MiB of a 64 MiB workspace) but not under 8 MiB (chorus.cuda.nccl.nccl_from: "
                    "torch's ProcessGroupNCCL, fingerprints agreed over chorus first, aborted when a peer "
                    "is lost), where NCCL's ring is faster than chorus's two-shot kernels "
                    "(docs/results/4xh200, speed-run-7/two-shot-shape); 0: chorus's kernels at every size, for every collective "
                    "(no call of any kind goes to NCCL then); needs torch with NCCL"),
    Setting("CHORUS_CUDA_NCCL_GATHER_FROM_BYTES", "int", 16 * MIB, minimum=0, unit="bytes",
            meaning="all_gather and reduce_scatter of equal blocks of CUDA tensors inside a host run on "
                    "NCCL's kernels from this many bytes of their whole buffer (W blocks; chorus.cuda.nccl, "
                    "as CHORUS_CUDA_NCCL_FROM_BYTES for all_reduce), where chorus's fused kernels fell behind "
                    "NCCL's on 4 H200s (docs/results/4xh200) and the hand-off matched NCCL (docs/results/2xh200); "
                    "0: chorus's fused kernels at every size"),
    Setting("CHORUS_CUDA_NCCL_ALL_TO_ALL", "bool", True,
            meaning="all_to_all of CUDA tensors inside a host runs on NCCL's kernels (chorus.cuda.nccl, as "
                    "CHORUS_CUDA_NCCL_FROM_BYTES), at every size: the ranks of one all_to_all send different "
                    "amounts, so no size could choose the same path on all of them; NCCL's grouped sends were "
                    "3-30x faster than chorus's channels (docs/results/4xh200/all_to_all-bf16-w4.txt); "
                    "off: chorus's channels"),
    Setting("CHORUS_CUDA_NCCL_BROADCAST", "bool", True,
            meaning="broadcast of CUDA tensors inside a host runs on NCCL's kernels (chorus.cuda.nccl, as "
                    "CHORUS_CUDA_NCCL_FROM_BYTES), at every size, where chorus's copies and barrier kernels "
                    "ran at 0.37-0.47x NCCL's speed from 1 KiB to 32 MiB on 4 H200s "
                    "(docs/results/4xh200/speed-run-6/broadcast.json); the group's first CUDA broadcast "
                    "then makes the group's NCCL communicator; off (or CHORUS_CUDA_NCCL_FROM_BYTES=0): "
                    "chorus's copies"),
    Setting("CHORUS_CUDA_NCCL_AGREE", "choice", "gpu", choices=("gpu", "cpu"),
            meaning="how a call handed to NCCL inside a host checks that every rank called the same op: "
                    "gpu: chorus's barrier kernel compares the fingerprints on the GPUs, on a stream beside "
                    "NCCL's kernel, the group's next op after it (no CPU waits for a peer, NCCL's kernel "
                    "does not wait for it: chorus.cuda.beside; a watcher "
                    "aborts the communicator on a mismatch, and a mismatched op raises at the next call or "
                    "wait, its outputs undefined); cpu: the ranks' CPUs compare them before anything is "
                    "queued (one round trip per call; a rank whose op took chorus's kernels is waited for "
                    "until the timeout)"),
    Setting("CHORUS_CUDA_STAGING", "bool", False,
            meaning="never map peers' GPU memory: stage CUDA tensors through pinned host memory "
                    "and the CPU components (what a failed CUDA IPC check falls back to)"),
    Setting("CHORUS_SHM_BYTES", "int", 64 * MIB, minimum=0, unit="bytes",
            meaning="shared memory a group's window may take (large groups get smaller slots); "
                    "point-to-point rings leave this much of /dev/shm free"),
    Setting("CHORUS_SHM_SLOT_BYTES", "int", minimum=0, unit="bytes",
            meaning="bytes per window slot (whole 4 KiB pages, at least 64 KiB); unset or 0: "
                    "1 MiB (2 MiB for 2 ranks), less to stay within CHORUS_SHM_BYTES"),
    Setting("CHORUS_SHM_ONESHOT_BYTES", "int", 64 * KIB, minimum=0, maximum=GIB, unit="bytes",
            meaning="all_reduce and reduce are one-shot (every rank reduces everything) while each "
                    "rank reads at most this many bytes of the others' data"),
    Setting("CHORUS_SHM_CMA", "bool", True,
            meaning="large messages are copied once, straight from the peer (process_vm_readv); "
                    "0 on any member turns it off for the group"),
    Setting("CHORUS_SHM_CMA_BYTES", "int", minimum=0, unit="bytes",
            meaning="size from which every collective copies once (1: always); unset or 0: the "
                    "sizes measured per collective and group size"),
    Setting("CHORUS_SHM_MAPPED", "bool", True,
            meaning="collectives use registered buffers (chorus.empty_shared, shared torch "
                    "tensors) in place; 0: such buffers go through the window"),
    Setting("CHORUS_SHM_MAPPED_BYTES", "int", 1 * MIB, minimum=0, unit="bytes",
            meaning="all_reduce and reduce use registered buffers from this size (0: never); "
                    "all_to_all too when set, else from 4 MiB"),
    Setting("CHORUS_SHM_THREADS", "int", minimum=1, unit="threads",
            meaning="threads per rank for large copies and reductions, the caller's included "
                    "(1: no helpers); unset: CPUs // ranks on the host, 1 to 4"),
    Setting("CHORUS_SHM_PART_BYTES", "int", 256 * KIB, minimum=1, unit="bytes",
            meaning="a phase is split among the threads only in parts of at least this many bytes"),
    Setting("CHORUS_SHM_COPY_CREW_BYTES", "int", 16 * MIB, minimum=0, unit="bytes",
            meaning="the copy path splits phases among the threads only for messages of at least "
                    "this many bytes per rank"),
    Setting("CHORUS_SHM_POLLS", "int", 200, minimum=0, unit="reads",
            meaning="reads of a missing rank's counter before a wait starts (clock, yields, naps)"),
    Setting("CHORUS_SHM_SPIN_US", "float", minimum=0, unit="microseconds",
            meaning="how long a waiter spins before it yields; unset: it spins only where every "
                    "rank of the host has a core of its own"),
    Setting("CHORUS_SHM_YIELD_US", "int", minimum=0, unit="microseconds",
            meaning="how long a waiter yields before it naps; unset or 0: 5 ms (1 ms with more "
                    "ranks than CPUs)"),
    # -- shared memory: point-to-point rings -----------------------------------------------
    Setting("CHORUS_SHM_P2P", "bool", True,
            meaning="large point-to-point payloads between ranks of one host go through "
                    "shared-memory rings (never with CHORUS_TRANSPORT=tcp)"),
    Setting("CHORUS_SHM_P2P_BYTES", "int", minimum=0, unit="bytes",
            meaning="bytes of each ring (whole 4 KiB pages, at least 4 KiB); unset or 0: 4 MiB, "
                    "less for large worlds (32 MiB per rank in all), no rings below 256 KiB"),
    Setting("CHORUS_SHM_P2P_MIN", "int", 256 * KIB, minimum=0, unit="bytes",
            meaning="point-to-point payloads of at least this many bytes go through the rings"),
    # -- torch -------------------------------------------------------------------------
    Setting("CHORUS_TORCH_SHARE", "bool", True,
            meaning="torch tensors reused by all_reduce or all_to_all move into shared memory, "
                    "where the ranks of a host reduce them in place"),
    Setting("CHORUS_TORCH_SHARE_BYTES", "int", 1 * MIB, minimum=0, unit="bytes",
            meaning="only tensor storages of at least this many bytes are moved"),
    # -- observability -----------------------------------------------------------------
    Setting("CHORUS_FLIGHT_RECORDER_SIZE", "int", 2000, minimum=0, maximum=1 << 24, unit="ops",
            meaning="ops each group's flight recorder keeps (chorus.debug); 0: no flight recorder"),
    Setting("CHORUS_FLIGHT_RECORDER_DIR", "str",
            meaning="every rank writes its flight recorder to DIR/rank<N>.json on a chorus error "
                    "(timeout, peer lost, mismatch) and on SIGTERM/SIGINT; read with chorus analyze "
                    "DIR; unset: dumps only when chorus.debug.dump_flight_recorder is called"),
    Setting("CHORUS_TRACE", "str",
            meaning="every rank writes PREFIX.rank<N>.json, a Chrome trace / Perfetto file of its "
                    "ops and transfers, when it leaves; chorus trace merge PREFIX -o job.json "
                    "aligns the ranks' clocks; unset: no trace"),
)


_lock = threading.Lock()
_overrides: dict[str, object] = {}  # name -> value (None: as if unset)
_ABSENT = object()


def setting(name: str) -> Setting:
    """The declaration of ``name``; UnknownSettingError if there is none."""
    found = SETTINGS.get(name)
    if found is None:
        raise UnknownSettingError(f"{name!r} is not a chorus setting: every CHORUS_* variable "
                                  f"is declared in chorus.config.SETTINGS (python -m chorus.config "
                                  f"lists them)")
    return found


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _overridden(name: str) -> tuple[bool, object]:
    with _lock:
        return (name in _overrides), _overrides.get(name)


def get(name: str, environ: Mapping[str, str] | None = None) -> object:
    """The effective value of setting ``name``: its override, else its value in
    ``environ`` (default ``os.environ``), else its default.  Raises ConfigError when the
    value is not valid or the name is not declared."""
    declared = setting(name)
    found, value = _overridden(name)
    if found:
        return declared.default if value is None else value
    return declared.parse(_environ(environ).get(name, ""))


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` is set (overridden, or non-blank in ``environ``), for code whose
    behaviour differs between "unset" and "set to the default"."""
    setting(name)
    found, value = _overridden(name)
    if found:
        return value is not None
    return bool(_environ(environ).get(name, "").strip())


def snapshot(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Every setting's effective value (see ``get``), e.g. once when a group is created."""
    return {name: get(name, environ) for name in SETTINGS}


def _as_text(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return format_value(value) if isinstance(value, (bool, float)) else str(value)


@contextlib.contextmanager
def override(**values: object) -> Iterator[None]:
    """Within the block, ``get`` returns these values whatever the environment says
    (None: as if unset).  Values are checked as the environment's are (ints as ints or
    their text, bools as True/False or their words, ...).  Blocks nest; each restores what
    it replaced.  Meant for tests: the values are seen by every thread."""
    parsed = {}
    for name, value in values.items():
        declared = setting(name)
        parsed[name] = None if value is None else declared.parse(_as_text(value))
    with _lock:
        saved = {name: _overrides.get(name, _ABSENT) for name in parsed}
        _overrides.update(parsed)
    try:
        yield
    finally:
        with _lock:
            for name, old in saved.items():
                if old is _ABSENT:
                    _overrides.pop(name, None)
                else:
                    _overrides[name] = old


# -- python -m chorus.config -------------------------------------------------------------

def _rows(environ: Mapping[str, str] | None) -> list[dict]:
    rows = []
    for name, declared in SETTINGS.items():
        row = {"name": name, "kind": declared.kind, "default": declared.default,
               "set": is_set(name, environ), "valid": declared.valid(), "meaning": declared.meaning}
        try:
            row["value"] = get(name, environ)
        except ConfigError as exc:
            row["value"], row["error"] = _environ(environ).get(name), str(exc)
        if declared.secret and row["value"] is not None:
            row["value"] = "(hidden)"
        rows.append(row)
    return rows


def main(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """``python -m chorus.config`` / ``chorus config``: print every setting's effective
    value, whether it is set or the default, and what it means.  Exit status 1 if any
    value is not valid (the table says which and why)."""
    p = argparse.ArgumentParser(
        prog="chorus config", description="Print every CHORUS_* setting: its effective value, whether "
        "it is set or the default, and its meaning (exit status 1 if a value is not valid).")
    p.add_argument("--json", action="store_true",
                   help="print a JSON object: name -> value, default, set, kind, valid, meaning "
                        "(and error where the value is not valid)")
    args = p.parse_args(argv)
    rows = _rows(environ)
    if args.json:
        print(json.dumps({row["name"]: {k: v for k, v in row.items() if k != "name"} for row in rows}, indent=2))
    else:
        width = max(len(name) for name in SETTINGS)
        values = [r["value"] if "error" in r or r["value"] == "(hidden)" else format_value(r["value"])
                  for r in rows]
        value_width = min(24, max(len(str(v)) for v in [*values, "VALUE"]))
        print(f"{'NAME':<{width}}  {'VALUE':<{value_width}}  {'SOURCE':<7}  MEANING")
        for row, value in zip(rows, values, strict=True):
            source = "INVALID" if "error" in row else "set" if row["set"] else "default"
            print(f"{row['name']:<{width}}  {value!s:<{value_width}}  {source:<7}  {row['meaning']}")
    errors = [row["error"] for row in rows if "error" in row]
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
