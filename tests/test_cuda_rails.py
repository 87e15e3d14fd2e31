"""chorus.cuda.rails' choices, on the CPU: which ranks form a rail, how a message is
sharded, which setting picks the rails' kind, and which calls the rails take (the GPU
runs are tests/gpu/test_cuda_hosts.py and test_cuda_failures_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from chorus.cuda import nccl, rails


def test_rails_are_the_ith_rank_of_every_host():
    assert rails.rails_of(((0, 1), (2, 3))) == ((0, 2), (1, 3))
    assert rails.rails_of(((0, 2, 4), (1, 3, 5))) == ((0, 1), (2, 3), (4, 5))
    assert rails.rails_of(((3, 0), (1, 2), (4, 5))) == ((3, 1, 4), (0, 2, 5))
    assert rails.rails_of(((0, 1, 2), (3,))) is None  # hosts of different sizes: no rails


@pytest.mark.parametrize("n,local,piece", [(10, 4, 3), (8, 4, 2), (1, 2, 1), (0, 4, 0), (7, 1, 7)])
def test_shards_cover_the_message(n, local, piece):
    assert rails.shard(n, local) == piece
    assert piece * local >= n > (piece - 1) * local or n == 0


@pytest.mark.parametrize("value,want", [("nccl", "nccl"), ("tcp", "tcp"), ("off", "off")])
def test_the_setting_names_the_kind(value, want, monkeypatch):
    monkeypatch.setenv("CHORUS_CUDA_RAILS", value)
    assert rails.rails_kind() == want


def test_auto_is_nccl_only_where_torch_has_it(monkeypatch):
    monkeypatch.setenv("CHORUS_CUDA_RAILS", "auto")
    try:
        import torch.distributed as dist
    except ImportError:
        assert rails.rails_kind() == "tcp"
        return
    assert rails.rails_kind() == ("nccl" if dist.is_nccl_available() else "tcp")


def test_no_rails_without_a_hierarchy_or_when_off(monkeypatch):
    monkeypatch.setenv("CHORUS_CUDA_RAILS", "nccl")
    assert rails.attach(SimpleNamespace(hierarchy=None, name="g"), "why") is None
    monkeypatch.setenv("CHORUS_CUDA_RAILS", "off")
    h = SimpleNamespace(by_host=((0, 1), (2, 3)))
    assert rails.attach(SimpleNamespace(hierarchy=h, name="g"), "why") is None
    monkeypatch.setenv("CHORUS_CUDA_RAILS", "tcp")
    uneven = SimpleNamespace(by_host=((0, 1, 2), (3,)))
    assert rails.attach(SimpleNamespace(hierarchy=uneven, name="g"), "why") is None


class _Tensor:
    def __init__(self, dtype):
        self.dtype = f"torch.{dtype}"


def _call(name, reduce_op="SUM", dtype="bfloat16", algorithm=None, uniform=True):
    return SimpleNamespace(name=name, reduce_op=reduce_op, algorithm=algorithm, buffers={"data": _Tensor(dtype)},
                           uniform=uniform)


def _rails(kind="nccl", all_reduce="flat"):
    """What supports() reads of a RailsComponent: the whole group's communicator (NCCL
    rails only) and CHORUS_CUDA_RAILS_ALL_REDUCE."""
    return SimpleNamespace(flat=object() if kind == "nccl" else None, flat_all_reduce=all_reduce == "flat")


@pytest.mark.parametrize("call,want", [
    (_call("all_reduce"), "nccl"),  # the default: one NCCL all_reduce over the whole group
    (_call("all_reduce", "AVG", "float32"), "nccl"),
    (_call("all_reduce", "MAX", "int64"), "nccl"),
    (_call("all_reduce", algorithm="rails"), "rails"),  # the phases, by name
    (_call("broadcast", ""), "rails"),
    (_call("all_gather", ""), "nccl"),
    (_call("reduce_scatter"), "nccl"),
    (_call("reduce_scatter", uniform=False), "staging"),  # NCCL's reduce_scatter takes equal blocks
    (_call("all_to_all", "", uniform=False), "nccl"),  # any splits (whether a rank's are equal differs by rank)
    (_call("all_reduce", "BXOR", "int32"), "staging"),  # NCCL has no bitwise reductions
    (_call("all_reduce", "SUM", "bool"), "staging"),
    (_call("all_reduce", "SUM", "float8_e4m3fn"), "staging"),
    (_call("all_reduce", algorithm="ring"), "staging"),  # a flat CPU algorithm asked for by name
    (_call("gather", ""), "staging"),
])
def test_which_calls_the_rails_take(call, want):
    assert rails.RailsComponent.supports(_rails(), call) == want


@pytest.mark.parametrize("kind,all_reduce,call,want", [
    ("nccl", "rails", _call("all_reduce"), "rails"),  # CHORUS_CUDA_RAILS_ALL_REDUCE=rails
    ("nccl", "rails", _call("all_reduce", algorithm="nccl"), "nccl"),  # the flat one, by name
    ("nccl", "rails", _call("all_gather", ""), "nccl"),
    ("tcp", "flat", _call("all_reduce"), "rails"),  # rails over TCP: no NCCL communicator at all
    ("tcp", "flat", _call("all_reduce", algorithm="nccl"), "staging"),
    ("tcp", "flat", _call("all_gather", ""), "staging"),
    ("tcp", "flat", _call("broadcast", ""), "rails"),
])
def test_the_settings_that_steer_the_rails(kind, all_reduce, call, want):
    assert rails.RailsComponent.supports(_rails(kind, all_reduce), call) == want


def test_the_rail_store_is_served_by_the_first_member():
    pytest.importorskip("torch.distributed")
    import gc

    from chorus.store.hash_store import HashStore

    chorus_store = HashStore()
    first = nccl.torch_store("chorus/rails/0/1/address", chorus_store, True, "127.0.0.1", 10.0)
    other = nccl.torch_store("chorus/rails/0/1/address", chorus_store, False, "127.0.0.1", 10.0)
    gc.collect()
    other.set("unique-id", b"abc")
    assert first.get("unique-id") == b"abc"
    assert chorus_store.get("chorus/rails/0/1/address") == f"127.0.0.1:{first.port}".encode()


def test_the_rail_store_is_on_the_transports_host(monkeypatch):
    """A rail's store is served where the rank's TCP transport listens (the address the
    other hosts reach it at), whatever prefix the transport's own keys have in the store."""
    from types import SimpleNamespace

    from chorus.store.hash_store import HashStore
    from chorus.store.prefix_store import PrefixStore
    from chorus.transport.tcp import TcpTransport

    monkeypatch.delenv("CHORUS_SOCKET_HOST", raising=False)
    store = PrefixStore("chorus/1", HashStore())  # (as init_process_group gives the transport)
    transport = TcpTransport(0, 1, store, token=b"t" * 32, timeout=10.0, host="127.0.0.2")
    try:
        assert nccl.serving_host(transport) == "127.0.0.2"
    finally:
        transport.close()
    assert nccl.serving_host(SimpleNamespace()) == "127.0.0.1"  # (a loopback transport: ranks as threads)
    monkeypatch.setenv("CHORUS_SOCKET_HOST", "10.1.2.3")
    assert nccl.serving_host(SimpleNamespace()) == "10.1.2.3"


def test_every_cuda_component_takes_the_lanes_async_argument():
    """The API calls ``all_reduce_now(tensor, op, async_op)`` and ``rows_now(name, output,
    input, op, async_op)`` on whichever CUDA component a group has (chorus.api): each must
    take them, or every call of a group across hosts after its first raises."""
    import inspect

    from chorus.cuda.component import CudaComponent
    from chorus.cuda.rails import RailsComponent

    for cls in (CudaComponent, RailsComponent):
        params = list(inspect.signature(cls.all_reduce_now).parameters)
        assert params[:4] == ["self", "tensor", "op", "async_op"], (cls.__name__, params)
        params = list(inspect.signature(cls.rows_now).parameters)  # (all_gather_into_tensor, reduce_scatter_tensor)
        assert params[:6] == ["self", "name", "output", "input", "op", "async_op"], (cls.__name__, params)
    rails = RailsComponent.__new__(RailsComponent)
    assert rails.rows_now("all_gather", None, None, None, True) is False  # (the general path runs the rails)


def test_each_rails_component_of_a_group_has_store_keys_of_its_own(monkeypatch):
    """Rails made twice for one group (a component attached again) publish their NCCL
    communicators' addresses under keys of their own, the same on every member: a member
    reading the last one's address would meet a bootstrap already gone."""
    import chorus as dist
    from chorus.api.state import current
    from chorus.store import HashStore
    from chorus.testing import run_threads

    monkeypatch.setenv("CHORUS_HOST_ID", "a,a,b,b")
    monkeypatch.setenv("CHORUS_CUDA_NCCL_GATHER_FROM_BYTES", str(1 << 20))  # (the host's communicator too)
    store = HashStore()

    def body(rank, world):
        current().store = store
        pg = current().default_group
        keys = []
        for _ in range(2):
            made = rails.RailsComponent(pg, pg.hierarchy, rails.rails_of(pg.hierarchy.by_host), "nccl")
            keys.append((made.peers.key, made.host_peers.key, made.flat.key))
            made.close()
            dist.barrier()  # (as the group's ops between two attaches would order its members)
        return keys

    got = run_threads(body, 4)
    for rank, keys in enumerate(got):
        assert keys[0] != keys[1] and not set(keys[0]) & set(keys[1]), keys
        assert [k[0] for k in keys] == [k[0] for k in got[rank % 2]]  # (a rail: the ranks at one place of each host)
        assert [k[1] for k in keys] == [k[1] for k in got[2 * (rank // 2)]]  # (a host's)
        assert [k[2] for k in keys] == [k[2] for k in got[0]]  # (the whole group's)


def _start_on_threads(monkeypatch, counts):
    """RailsComponent.start of an all_reduce (the whole group's NCCL path) on 4 ranks as
    threads, two simulated hosts of two, rank r with ``counts[r]`` elements; the NCCL
    communicator replaced by a recorder (no GPU): each rank's outcome (None or the
    exception), and the ops each queued on NCCL."""
    import torch

    from chorus.api.state import current
    from chorus.call import make
    from chorus.store import HashStore
    from chorus.testing import run_threads

    monkeypatch.setenv("CHORUS_HOST_ID", "a,a,b,b")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: SimpleNamespace(device="cuda:0"))
    store = HashStore()
    queued = {r: [] for r in range(4)}

    def body(rank, world):
        current().store = store
        pg = current().default_group
        made = rails.RailsComponent(pg, pg.hierarchy, rails.rails_of(pg.hierarchy.by_host), "nccl")
        made.flat.run = lambda call: queued[rank].append((call.name, call.count))
        data = np.ones(counts[rank], np.float32)
        call = make(pg, "all_reduce", dtype="float32", count=data.size, buffers={"data": data}, async_op=False,
                    algorithm=None, nbytes=data.nbytes, args={"count": data.size}, reduce_op="SUM")
        try:
            made.start(call, made.supports(SimpleNamespace(name="all_reduce", reduce_op="SUM", algorithm=None,
                                                            buffers={"data": _Tensor("float32")}, uniform=True)))
            return None
        except Exception as exc:  # noqa: BLE001 - the outcome
            return exc
        finally:
            made.close()

    return run_threads(body, 4), [queued[r] for r in range(4)]


def test_an_all_reduce_across_hosts_goes_to_the_flat_communicator_after_every_rank_agreed(monkeypatch):
    """Every rank agrees the op's fingerprint over the whole group, then queues it on the
    whole group's NCCL communicator (recorded here)."""
    pytest.importorskip("torch")
    got, queued = _start_on_threads(monkeypatch, [1024] * 4)
    assert got == [None] * 4 and queued == [[("all_reduce", 1024)]] * 4, (got, queued)


def test_one_rank_calling_another_op_across_hosts_fails_every_rank_before_nccl(monkeypatch):
    """Rank 3 (host b, rail 1) passes another count: every rank raises
    CollectiveMismatchError, rank 0 too (which shares neither its host nor its rail), and
    none queues anything on NCCL."""
    from chorus.errors import CollectiveMismatchError

    pytest.importorskip("torch")
    got, queued = _start_on_threads(monkeypatch, [1024, 1024, 1024, 2048])
    assert all(isinstance(e, CollectiveMismatchError) for e in got), got
    assert "count=2048" in str(got[0]), got[0]
    assert queued == [[]] * 4, queued
