"""Safe objects (chorus/api/safe_pickle.py): without a job token, object collectives
unpickle only allow-listed globals, so a peer's object cannot run code in the receiver;
CHORUS_OBJECT_PICKLE and a token choose full pickle; chorus.add_safe_globals extends the list."""

import collections
import datetime
import decimal
import fractions
import pickle
from dataclasses import dataclass

import numpy as np
import pytest

import chorus as dist
from chorus import config
from chorus.api.safe_pickle import ObjectDecoder
from chorus.errors import UnsafeObjectError
from chorus.testing import run_processes, run_threads


class CreatesFile:
    """Unpickling it opens ``path`` for writing (creates the file): code chosen by the sender."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@dataclass
class Point:
    x: int
    y: int


@pytest.fixture(autouse=True)
def _no_registrations():
    dist.clear_safe_globals()
    yield
    dist.clear_safe_globals()


def _send_with(op: str, rank: int, world: int, obj):
    """Rank 1 sends ``obj`` to rank 0 (or to all) with ``op``; return what this rank got."""
    if op == "all_gather_object":
        out = [None] * world
        dist.all_gather_object(out, obj if rank == 1 else "plain")
        return out
    if op == "broadcast_object_list":
        out = [obj, "plain"] if rank == 1 else [None, None]
        dist.broadcast_object_list(out, src=1)
        return out
    if op == "gather_object":
        out = [None] * world if rank == 0 else None
        dist.gather_object(obj if rank == 1 else "plain", out, dst=0)
        return out
    if op == "scatter_object_list":
        out = [None]
        dist.scatter_object_list(out, [obj] * world if rank == 1 else None, src=1)
        return out
    if rank == 1:  # send_object_list / recv_object_list
        dist.send_object_list(["plain", obj], dst=0)
        return None
    out = [None, None]
    dist.recv_object_list(out, src=1)
    return out


OPS = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
       "recv_object_list"]
#: the ranks that unpickle rank 1's object in each op
RECEIVERS = {"all_gather_object": [0, 1], "broadcast_object_list": [0], "gather_object": [0],
             "scatter_object_list": [0, 1], "recv_object_list": [0]}


# -- the acceptance test: a hostile object in a job without a token ------------------------------
@pytest.mark.parametrize("op", OPS)
def test_without_a_token_an_object_that_would_create_a_file_creates_nothing(op, tmp_path):
    target = tmp_path / "pwned"
    results = run_threads(lambda rank, world: _send_with(op, rank, world, CreatesFile(target)), 2,
                          return_exceptions=True)
    assert not target.exists()
    for rank in RECEIVERS[op]:
        error = results[rank]
        assert isinstance(error, UnsafeObjectError) and isinstance(error, pickle.UnpicklingError), error
        assert (error.global_name, error.op, error.sender) == ("io.open", op, 1)
        message = str(error)
        assert message.startswith(f"{op}: refused to unpickle the object sent by rank 1: it needs "
                                  "the global io.open")
        for fix in ("chorus.add_safe_globals([open])", "CHORUS_TOKEN", "CHORUS_OBJECT_PICKLE=full",
                    "the job has no token"):
            assert fix in message, fix


def test_full_mode_unpickles_the_same_object(tmp_path):
    target = tmp_path / "made"

    def body(rank, world):
        out = _send_with("all_gather_object", rank, world, CreatesFile(target))
        out[1].close()
        return type(out[1]).__name__

    with config.override(CHORUS_OBJECT_PICKLE="full"):
        assert run_threads(body, 2) == ["TextIOWrapper", "TextIOWrapper"]
    assert target.exists()


def test_safe_mode_refuses_even_with_a_token_and_auto_trusts_a_token(tmp_path):
    data = pickle.dumps(CreatesFile(tmp_path / "x"))
    with config.override(CHORUS_OBJECT_PICKLE="safe"):
        with pytest.raises(UnsafeObjectError, match="CHORUS_OBJECT_PICKLE=safe") as info:
            ObjectDecoder("broadcast_object_list", authenticated=True)(data, 3)
    assert "sent by rank 3" in str(info.value) and not (tmp_path / "x").exists()
    with pytest.raises(UnsafeObjectError, match="sent by a peer"):
        ObjectDecoder("recv_object_list", authenticated=False)(data)
    ObjectDecoder("recv_object_list", authenticated=True)(data).close()  # auto + token: full pickle
    assert (tmp_path / "x").exists()


def _token_job(rank, world, path):
    out = _send_with("broadcast_object_list", rank, world, CreatesFile(path))
    if rank == 0:  # the receiver: it opened the file
        out[0].close()
    return dist.group.WORLD.transport.authenticated


@pytest.mark.slow
def test_a_job_with_a_token_unpickles_anything(tmp_path):
    target = tmp_path / "made-over-tcp"  # chorus.spawn gives the job a token
    assert run_processes(_token_job, 2, str(target)) == [True, True]
    assert target.exists()


# -- what safe mode accepts -------------------------------------------------------------------------
def _safe_values():
    counter = collections.Counter("abca")
    return [None, True, 3, 2.5, 1 + 2j, "s", b"b", bytearray(b"ba"), (1, "t"), [1, [2]], {1: {2: 3}},
            {1, 2}, frozenset({3}), slice(1, 5, 2), range(2, 9, 3), ..., NotImplemented,
            collections.OrderedDict(a=1), collections.defaultdict(list, a=[1]), collections.deque([1, 2]),
            counter, datetime.date(2024, 5, 1), datetime.time(12, 30),
            datetime.datetime(2024, 5, 1, 12, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
            datetime.timedelta(seconds=5), decimal.Decimal("1.10"), fractions.Fraction(1, 3)]


def _arrays():
    return [np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(6, dtype=np.int16)[::2],
            np.array(["a", "bc"]), np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
            np.array([{"k": 1}, None], dtype=object), np.zeros((0, 3), np.int8),
            np.float32(1.5), np.int64(-3), np.bool_(True), np.datetime64("2024-05-01"), np.dtype("f2")]


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return type(b) is np.ndarray and a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
    return type(a) is type(b) and a == b


def test_safe_mode_round_trips_builtins_numpy_and_registered_classes():
    dist.add_safe_globals([Point])
    values = [*_safe_values(), *_arrays(), Point(1, 2)]

    def body(rank, world):
        out = [None] * world
        dist.all_gather_object(out, values if rank == 1 else None)
        return out[1]

    for got in run_threads(body, 2):
        assert len(got) == len(values)
        for sent, back in zip(values, got, strict=True):
            assert _equal(sent, back), (sent, back)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_numpy_arrays_decode_in_safe_mode_at_every_protocol(protocol):
    decode = ObjectDecoder("all_gather_object", authenticated=False)
    for value in _arrays():
        assert _equal(value, decode(pickle.dumps(value, protocol=protocol)))


def test_torch_tensors_dtypes_devices_and_sizes_round_trip_in_safe_mode():
    torch = pytest.importorskip("torch")
    values = [torch.arange(6.0).reshape(2, 3), torch.ones(3, dtype=torch.bfloat16)[1:],
              torch.arange(4).t(), torch.zeros((), dtype=torch.int64), torch.ones(2).requires_grad_(),
              torch.nn.Parameter(torch.ones(2)), torch.float16, torch.complex64, torch.device("cpu"),
              torch.Size([2, 3]), torch.strided]

    def body(rank, world):
        out = [values if rank == 0 else None]
        dist.broadcast_object_list(out, src=0)
        return out[0]

    got = run_threads(body, 2)[1]
    for sent, back in zip(values, got, strict=True):
        assert type(back) is type(sent), (sent, back)
        if isinstance(sent, torch.Tensor):
            assert back.dtype == sent.dtype and torch.equal(back, sent)
            assert back.requires_grad == sent.requires_grad
        else:
            assert back == sent


# -- what safe mode refuses, and how --------------------------------------------------------------
def test_a_refused_module_is_not_even_imported():
    data = b"cchorus_no_such_module_xyz\nfn\n(tR."  # protocol 0: GLOBAL, then call it
    with pytest.raises(UnsafeObjectError, match="chorus_no_such_module_xyz.fn"):  # not ModuleNotFoundError
        ObjectDecoder("gather_object", authenticated=False)(data, 0)


@pytest.mark.parametrize("name", ["torch.load", "torch.save", "builtins.eval", "builtins.getattr",
                                  "os.system", "builtins.type", "numpy.load", "collections.namedtuple"])
def test_dangerous_globals_are_refused(name):
    module, _, attr = name.rpartition(".")
    data = f"c{module}\n{attr}\n(tR.".encode()
    with pytest.raises(UnsafeObjectError, match=rf"the global {name}\b"):
        ObjectDecoder("all_gather_object", authenticated=False)(data)


class _Storage:
    """Pickles as torch.storage._load_from_bytes(payload): torch's own decoder of a tensor's
    storage, which runs torch.load(weights_only=False) on the payload."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def __reduce__(self):
        import torch.storage

        return torch.storage._load_from_bytes, (self.payload,)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch, of the crafted payload
def test_a_tensor_storage_is_decoded_by_torchs_restricted_loader(tmp_path):
    pytest.importorskip("torch")
    target = tmp_path / "via-storage"
    data = pickle.dumps(_Storage(pickle.dumps(CreatesFile(target))))
    with pytest.raises(pickle.UnpicklingError):
        ObjectDecoder("broadcast_object_list", authenticated=False)(data, 0)
    assert not target.exists()
    with config.override(CHORUS_OBJECT_PICKLE="full"):  # what the check prevents
        with pytest.raises(Exception):  # noqa: B017 - the payload is no storage, after it ran
            ObjectDecoder("broadcast_object_list", authenticated=False)(data, 0)
    assert target.exists()


def test_add_get_and_clear_safe_globals():
    data = pickle.dumps(Point(3, 4))
    decode = ObjectDecoder("all_gather_object", authenticated=False)
    with pytest.raises(UnsafeObjectError, match=r"chorus.add_safe_globals\(\[Point\]\)"):
        decode(data)
    dist.add_safe_globals([Point])
    assert decode(data) == Point(3, 4) and dist.get_safe_globals() == [Point]
    dist.clear_safe_globals()
    assert dist.get_safe_globals() == []
    with pytest.raises(UnsafeObjectError):
        decode(data)
    alias = (Point, f"{Point.__module__}.Point")  # (object, "module.name")
    dist.add_safe_globals([alias])
    assert decode(data) == Point(3, 4) and dist.get_safe_globals() == [alias]
    with pytest.raises(dist.InvalidArgumentError, match="__qualname__"):
        dist.add_safe_globals([3])


def test_registered_globals_are_returned_without_importing_their_module():
    marker = object()
    dist.add_safe_globals([(marker, "chorus_no_such_module_xyz.thing")])
    assert ObjectDecoder("op", authenticated=False)(b"cchorus_no_such_module_xyz\nthing\n.") is marker

