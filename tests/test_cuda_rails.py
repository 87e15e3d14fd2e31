"""chorus.cuda.rails' choices, on the CPU: which ranks form a rail, how a message is
sharded, which setting picks the rails' kind, and which calls the rails take (the GPU
runs are tests/gpu/test_cuda_hosts.py and test_cuda_failures_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

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


def _call(name, reduce_op="SUM", dtype="bfloat16", algorithm=None):
    return SimpleNamespace(name=name, reduce_op=reduce_op, algorithm=algorithm, buffers={"data": _Tensor(dtype)})


@pytest.mark.parametrize("call,want", [
    (_call("all_reduce"), "rails"),
    (_call("all_reduce", "AVG", "float32"), "rails"),
    (_call("all_reduce", "MAX", "int64"), "rails"),
    (_call("broadcast", ""), "rails"),
    (_call("all_reduce", "BXOR", "int32"), "staging"),  # NCCL has no bitwise reductions
    (_call("all_reduce", "SUM", "bool"), "staging"),
    (_call("all_reduce", "SUM", "float8_e4m3fn"), "staging"),
    (_call("all_reduce", algorithm="ring"), "staging"),  # a flat algorithm asked for by name
    (_call("all_gather", ""), "staging"),
    (_call("all_to_all", ""), "staging"),
])
def test_which_calls_the_rails_take(call, want):
    assert rails.RailsComponent.supports(None, call) == want


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


def test_the_rail_store_is_on_the_transports_host():
    from chorus.store.hash_store import HashStore

    chorus_store = HashStore()
    chorus_store.set("tcp/addr/3", "10.1.2.3:4567")
    assert nccl.serving_host(chorus_store, 3) == "10.1.2.3"
    assert nccl.serving_host(chorus_store, 2) == "127.0.0.1"


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
