"""Which CUDA all_reduces chorus.cuda hands to NCCL (chorus.cuda.nccl), decided on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from chorus.components.hierarchy import HIDDEN  # noqa: E402
from chorus.cuda import nccl  # noqa: E402
from chorus.cuda.component import CudaComponent  # noqa: E402
from chorus.cuda.nccl import nccl_handoff  # noqa: E402


@pytest.mark.parametrize("setting, group_id, has_nccl, want", [
    (str(8 << 20), 0, True, True),
    (str(8 << 20), 5, True, True),
    ("0", 0, True, False),  # off
    (str(8 << 20), 0, False, False),  # torch without NCCL
    (str(8 << 20), HIDDEN | 3 << 12 | 1, True, False),  # a host's hidden sub-group
])
def test_which_groups_hand_off(setting, group_id, has_nccl, want, monkeypatch):
    monkeypatch.setenv("CHORUS_CUDA_NCCL_FROM_BYTES", setting)
    monkeypatch.setattr(nccl, "nccl_available", lambda: has_nccl)
    assert nccl_handoff(SimpleNamespace(id=group_id)) is want


@pytest.mark.parametrize("nbytes, reduce_op, dtype, algorithm, want", [
    (8 << 20, "SUM", torch.float32, None, True),
    (8 << 20, "AVG", torch.bfloat16, None, True),
    (8 << 20, "MAX", torch.int64, None, True),
    ((8 << 20) - 1, "SUM", torch.float32, None, False),  # under the size
    (8 << 20, "BXOR", torch.int32, None, False),  # NCCL has no bitwise ops
    (8 << 20, "SUM", torch.bool, None, False),  # nor chorus's bool reductions
    (8 << 20, "SUM", torch.int16, None, False),  # NCCL has no int16
    (8 << 20, "SUM", torch.complex64, None, False),  # nor complex
    (8 << 20, "SUM", torch.float32, "two_shot", False),  # chorus's kernel, by name
    (1024, "SUM", torch.float32, "nccl", True),  # by name, at any size
])
def test_which_calls_hand_off(nbytes, reduce_op, dtype, algorithm, want):
    call = SimpleNamespace(name="all_reduce", algorithm=algorithm, nbytes=nbytes, reduce_op=reduce_op, uniform=True,
                           buffers={"data": torch.empty(4, dtype=dtype)})
    assert CudaComponent._on_nccl(_component(), call) is want


def _component(nccl_from=8 << 20, gather_from=0, exchange=True, world=4, handoff=True, broadcast=True):
    return SimpleNamespace(_nccl_from=nccl_from, _nccl_gather_from=gather_from, _nccl_exchange=exchange,
                           _nccl_broadcast=broadcast, _handoff=handoff, pg=SimpleNamespace(size=lambda: world))


@pytest.mark.parametrize("setting, workspace, want", [
    (None, 64 << 20, 14_589_952),  # the default (16 MiB): one two-shot round of the slot is less
    (None, 4 << 20, 8 << 20),  # a small workspace's rounds stay chorus's up to 8 MiB
    (str(4 << 20), 64 << 20, 4 << 20),  # a setting under one round: the setting
    ("0", 64 << 20, 0),  # off
    (str(32 << 20), None, 32 << 20),  # no workspace (staging): the setting
])
def test_the_hand_off_size_never_leaves_a_message_in_several_two_shot_rounds(setting, workspace, want, monkeypatch):
    from chorus.cuda.layout import Layout, two_shot_chunk

    if setting is None:
        monkeypatch.delenv("CHORUS_CUDA_NCCL_FROM_BYTES", raising=False)
    else:
        monkeypatch.setenv("CHORUS_CUDA_NCCL_FROM_BYTES", setting)
    layout = None if workspace is None else Layout.of(4, workspace)
    got = nccl.nccl_from(layout)
    assert got == want
    if layout is not None and got > nccl.ROUNDS_NCCL_FROM_BYTES:
        for item in (1, 2, 4, 8, 16):  # every message under it fits one round, whatever its dtype
            assert (got - item) // item <= two_shot_chunk(layout.slot, item, 4)


def test_no_hand_off_when_off():
    call = SimpleNamespace(name="all_reduce", algorithm=None, nbytes=1 << 30, reduce_op="SUM", uniform=True,
                           buffers={"data": torch.empty(4)})
    assert CudaComponent._on_nccl(_component(nccl_from=0), call) is False
    by_name = SimpleNamespace(**{**vars(call), "algorithm": "nccl"})
    assert CudaComponent._on_nccl(_component(handoff=False), by_name) is False  # a group that never hands off


@pytest.mark.parametrize("name, per_rank, uniform, algorithm, gather_from, want, dtype", [
    ("all_gather", 2 << 20, True, None, 8 << 20, True, torch.bfloat16),  # 4 blocks of 2 MiB: 8 MiB in all
    ("all_gather", (2 << 20) - 2, True, None, 8 << 20, False, torch.bfloat16),
    ("reduce_scatter", 4 << 20, True, None, 8 << 20, True, torch.bfloat16),
    ("reduce_scatter", 4 << 20, False, None, 8 << 20, False, torch.bfloat16),  # uneven blocks stay on chorus's kernels
    ("all_gather", 64 << 20, True, None, 0, False, torch.bfloat16),  # 0: off
    ("all_gather", 1024, True, "nccl", 8 << 20, True, torch.bfloat16),  # by name
    ("reduce_scatter", 1024, True, "nccl", 0, True, torch.bfloat16),  # by name, with the size-chosen hand-off off
    ("all_gather", 4 << 20, True, None, 8 << 20, True, torch.int16),  # moved as bytes: any dtype
    ("reduce_scatter", 4 << 20, True, None, 8 << 20, False, torch.int16),  # reduced: NCCL's dtypes only
])
def test_which_gathers_hand_off(name, per_rank, uniform, algorithm, gather_from, want, dtype):
    call = SimpleNamespace(name=name, algorithm=algorithm, nbytes=per_rank, uniform=uniform,
                           reduce_op="SUM" if name == "reduce_scatter" else "",
                           buffers={"input": torch.empty(4, dtype=dtype)})
    assert CudaComponent._on_nccl(_component(gather_from=gather_from), call) is want


@pytest.mark.parametrize("largest_block, uniform, algorithm, exchange, want", [
    (0, True, None, True, True),  # every size, an empty block too: the same on every rank
    (2, True, None, True, True),
    (1 << 20, False, None, True, True),  # uneven splits too
    (1 << 20, True, None, False, False),  # off: chorus's channels
    (1024, True, "channels", True, False),  # chorus's, by name
])
def test_which_all_to_alls_hand_off(largest_block, uniform, algorithm, exchange, want):
    call = SimpleNamespace(name="all_to_all", algorithm=algorithm, nbytes=largest_block, uniform=uniform,
                           reduce_op="", buffers={"input": torch.empty(4, dtype=torch.bfloat16)})
    assert CudaComponent._on_nccl(_component(exchange=exchange), call) is want


@pytest.mark.parametrize("nbytes, algorithm, broadcast, want", [
    (2, None, True, True),  # every size: NCCL's kernels were faster at each one measured
    (64 << 20, None, True, True),
    (64 << 20, None, False, False),  # off: chorus's copies
    (1024, "one_shot", True, False),  # chorus's, by name
    (1024, "nccl", False, True),  # NCCL's, by name
])
def test_which_broadcasts_hand_off(nbytes, algorithm, broadcast, want):
    call = SimpleNamespace(name="broadcast", algorithm=algorithm, nbytes=nbytes, uniform=True, reduce_op="",
                           root=1, buffers={"data": torch.empty(4, dtype=torch.int16)})
    assert CudaComponent._on_nccl(_component(broadcast=broadcast), call) is want


def test_a_broadcast_reaches_nccl_as_bytes_from_the_root_s_index():
    """NcclPeers.run hands NCCL the flat tensor's bytes (any dtype) and the root's index
    among the communicator's members."""
    from chorus.cuda.nccl import NcclPeers

    got = []

    class Group:
        def broadcast(self, tensors, opts):
            got.append((tensors[0].dtype, tensors[0].numel(), opts.rootRank))
            return SimpleNamespace(wait=lambda: None)

    peers = NcclPeers.__new__(NcclPeers)
    peers.ranks, peers.nccl = (1, 3, 4), Group()
    peers.group = lambda: peers.nccl
    data = torch.zeros(6, dtype=torch.int16)
    peers.run(SimpleNamespace(name="broadcast", buffers={"data": data}, root=3))
    assert got == [(torch.uint8, 12, 1)]


def test_synchronous_hand_offs_run_on_the_current_stream():
    """A hand-off the caller's stream waits for asks ProcessGroupNCCL to queue it on the
    current stream (asyncOp off, as torch's synchronous calls do; it may then return no
    Work, or one to wait for); an async all_reduce stays on NCCL's stream, its Work
    returned unwaited."""
    from chorus.cuda.nccl import NcclPeers

    seen = []

    class Work:
        def __init__(self, name):
            self.name = name

        def wait(self):
            seen.append(("wait", self.name))

    class Group:
        def allreduce(self, tensors, opts):
            seen.append(("all_reduce", opts.asyncOp))
            return Work("all_reduce") if opts.asyncOp else None  # (torch makes none for a sync op)

        def _allgather_base(self, output, tensor, opts):
            seen.append(("all_gather", opts.asyncOp))
            return Work("all_gather")  # (an older torch's Work: waited)

        def _reduce_scatter_base(self, output, tensor, opts):
            seen.append(("reduce_scatter", opts.asyncOp))

        def alltoall_base(self, output, tensor, recv, send, opts):
            seen.append(("all_to_all", opts.asyncOp))

        def broadcast(self, tensors, opts):
            seen.append(("broadcast", opts.asyncOp))

    peers = NcclPeers.__new__(NcclPeers)
    peers.ranks, peers.nccl, peers.reduce_options = (0, 1), Group(), {}
    peers.group = lambda: peers.nccl
    t = torch.zeros(4)
    assert peers.all_reduce(t, "SUM") is None
    work = peers.all_reduce(t, "SUM", wait=False)
    assert isinstance(work, Work) and peers.all_reduce(t, "SUM") is None
    peers.all_gather(torch.zeros(8), t)
    peers.reduce_scatter(torch.zeros(2), t, "SUM")
    peers.all_to_all(t, t, [2, 2], [2, 2])
    peers.broadcast(t, 1)
    assert seen == [("all_reduce", False), ("all_reduce", True), ("all_reduce", False), ("all_gather", False),
                    ("wait", "all_gather"), ("reduce_scatter", False), ("all_to_all", False), ("broadcast", False)]


def test_each_communicator_a_group_makes_has_its_own_address_key():
    """Two components of one group (the API's and one attached beside it, or one attached
    again) make two communicators: each is published under a key of its own, the same on
    every member, so no member reads the other's stale address."""
    from chorus.api.state import current
    from chorus.store import HashStore
    from chorus.testing import run_threads

    store = HashStore()  # (the job's store: threads of one test share one)

    def body(rank, world):
        current().store = store
        keys = []
        for _ in range(2):
            peers = nccl.group_peers(current().default_group)
            keys.append(peers.key)
            peers.close()
        return keys

    first, second = run_threads(body, 2)
    assert first == second and first[0] != first[1], (first, second)


def _agree_on_threads(fingerprints):
    """NcclPeers.agree on 3 ranks (threads over loopback), rank r with fingerprints[r]:
    each rank's outcome (None or the exception)."""
    from chorus.api.state import current
    from chorus.components import select
    from chorus.components.hierarchy import hidden_subgroup
    from chorus.cuda.nccl import NcclPeers
    from chorus.testing import run_threads

    def body(rank, world):
        pg = current().default_group
        sub = hidden_subgroup(pg, nccl.NCCL_INDEX, tuple(range(world)), "g0/nccl")
        select.attach(sub, settings=False)
        peers = NcclPeers(pg, tuple(range(world)), sub, "cuda/0/nccl/address")
        try:
            for seq in range(3):  # agreeing calls in a row, then ...
                peers.agree(SimpleNamespace(name="all_reduce", seq=seq, fingerprint=fingerprints[0]))
            peers.agree(SimpleNamespace(name="all_reduce", seq=3, fingerprint=fingerprints[rank]))  # ... its own
            return None
        except Exception as exc:  # noqa: BLE001 - the outcome
            return exc
        finally:
            peers.close()

    return run_threads(body, len(fingerprints))


def test_agreeing_members_go_on():
    big = (1 << 64) - 5  # a fingerprint with the top bit set: a negative int64
    assert _agree_on_threads([big, big, big]) == [None, None, None]


def test_a_member_that_called_another_op_fails_every_member_before_nccl():
    from chorus.errors import CollectiveMismatchError

    got = _agree_on_threads([11, 12, 11])
    assert all(isinstance(e, CollectiveMismatchError) for e in got), got
    assert "rank(s) [1]" in str(got[0]) and "rank(s) [0, 2]" in str(got[1]), got


def test_one_member_on_another_host_calling_another_op_fails_every_member(monkeypatch):
    """Two simulated hosts of two (chorus.cuda.rails' whole-group agreement): only the last
    rank differs, and every rank raises, also rank 0, which shares neither a host nor a
    rail with it (a rail's and a host's check alone would let rank 0 through)."""
    from chorus.errors import CollectiveMismatchError

    monkeypatch.setenv("CHORUS_HOST_ID", "a,a,b,b")
    got = _agree_on_threads([11, 11, 11, 12])
    assert all(isinstance(e, CollectiveMismatchError) for e in got), got
    assert "rank(s) [0, 1, 2]" in str(got[3]), got


def test_the_watcher_aborts_the_communicator_once_its_word_is_set_and_stops_at_close():
    """NcclPeers.watch: a word of host memory that a barrier in front of NCCL's kernel
    sets when the ranks' ops differ aborts the communicator (NCCL's kernel queued behind
    would wait forever); close() stops the watcher before the caller unmaps the word."""
    import threading

    import numpy as np

    from chorus.api.state import current
    from chorus.components import select
    from chorus.components.hierarchy import hidden_subgroup
    from chorus.cuda import nccl
    from chorus.testing import run_threads

    def body(rank, world):
        pg = current().default_group
        sub = hidden_subgroup(pg, nccl.NCCL_INDEX, tuple(range(world)), "g0/nccl")
        select.attach(sub, settings=False)
        peers = nccl.NcclPeers(pg, tuple(range(world)), sub, "cuda/0/nccl/address")
        aborted = threading.Event()
        peers.nccl = SimpleNamespace(abort=aborted.set)  # as made at the first op
        words = np.zeros(8, dtype=np.int64)
        peers.watch(words, 1)
        peers.watch(words, 1)  # once per communicator
        assert not aborted.wait(3 * nccl.WATCH_S)  # (the word is clear: nothing happens)
        words[1] = 4  # a barrier found another op
        assert aborted.wait(30), "the watcher did not abort the communicator"
        watcher = peers.watcher
        peers.close()
        assert not watcher.is_alive()
        return True

    assert run_threads(body, 2) == [True, True]


def test_close_stops_a_watcher_that_never_fired():
    import numpy as np

    from chorus.api.state import current
    from chorus.components import select
    from chorus.components.hierarchy import hidden_subgroup
    from chorus.cuda import nccl
    from chorus.testing import run_threads

    def body(rank, world):
        pg = current().default_group
        sub = hidden_subgroup(pg, nccl.NCCL_INDEX, tuple(range(world)), "g0/nccl")
        select.attach(sub, settings=False)
        peers = nccl.NcclPeers(pg, tuple(range(world)), sub, "cuda/0/nccl/address")
        peers.watch(np.zeros(8, dtype=np.int64), 1)
        watcher = peers.watcher
        peers.close()
        return watcher.is_alive()

    assert run_threads(body, 2) == [False, False]
