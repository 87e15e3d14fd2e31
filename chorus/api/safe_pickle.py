"""Unpickling what peers sent: in full, or restricted to an allow-list of safe globals.

Senders always pickle (``pickle.dumps``).  Unpickling calls whatever callable the bytes
name, so a peer that is not who it claims to be can run code in the receiver.  The
receiver therefore decodes with ``SafeUnpickler`` unless the job's peers are
authenticated (a job token) or ``CHORUS_OBJECT_PICKLE=full`` says to trust them::

    CHORUS_OBJECT_PICKLE   job token   decoded with
    auto (default)         none        SafeUnpickler
    auto                   set         pickle.loads
    safe                   either      SafeUnpickler
    full                   either      pickle.loads

``SafeUnpickler`` resolves only these globals (as ``torch.load(weights_only=True)``
does); any other raises ``UnsafeObjectError`` naming it, before anything of it runs:

- builtin containers and scalars: dict, list, tuple, set, frozenset, str, bytes,
  bytearray, int, float, complex, bool, slice, range, object, Ellipsis, NotImplemented
  (None, True, ... need no global);
- ``collections`` OrderedDict, defaultdict, deque, Counter; ``datetime`` date, time,
  datetime, timedelta, timezone; ``decimal.Decimal``; ``fractions.Fraction``;
- numpy arrays, dtypes and scalars (what ``ndarray.__reduce_ex__`` names, numpy 1 and 2);
- torch tensors (dense, and ``nn.Parameter``), dtypes, devices, layouts and ``Size``: a
  tensor's storage arrives as bytes that torch decodes with ``torch.load(weights_only=True)``;
- what ``add_safe_globals`` registered (returned as registered, without importing).

This is the pickle documentation's "restricting globals": every callable the bytes can
reach is one of these.  It stops code from running; it does not bound memory (``bytearray(2**40)`` is allowed):
the transport's limits on what a peer may send do that.
"""

from __future__ import annotations

import importlib
import io
import pickle
import threading
from collections.abc import Iterable
from typing import Any

from chorus import config
from chorus.errors import InvalidArgumentError, UnsafeObjectError

_NUMPY = [f"{core}.{name}"
          for core in ("numpy.core.multiarray", "numpy._core.multiarray") for name in ("_reconstruct", "scalar")]
_NUMPY += [f"{core}._frombuffer" for core in ("numpy.core.numeric", "numpy._core.numeric")]

#: "module.name" of every global SafeUnpickler resolves by importing it
ALLOWED = frozenset([
    *(f"builtins.{name}" for name in ("dict", "list", "tuple", "set", "frozenset", "str", "bytes", "bytearray",
                                      "int", "float", "complex", "bool", "slice", "range", "object",
                                      "Ellipsis", "NotImplemented")),
    *(f"collections.{name}" for name in ("OrderedDict", "defaultdict", "deque", "Counter")),
    *(f"datetime.{name}" for name in ("date", "time", "datetime", "timedelta", "timezone")),
    "decimal.Decimal", "fractions.Fraction",
    "_codecs.encode",  # how protocols 0-2 write bytes
    "numpy.ndarray", "numpy.dtype", *_NUMPY,
    *(f"torch._utils.{name}" for name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3",
                                          "_rebuild_parameter")),
    "torch.Size", "torch.device", "torch.serialization._get_layout",
])
#: a tensor's storage: torch names a function that runs torch.load(weights_only=False)
STORAGE = "torch.storage._load_from_bytes"

_lock = threading.Lock()
_registered: dict[str, tuple[Any, Any]] = {}  # "module.qualname" -> (entry as given, object)


def _named(entry: Any) -> tuple[str, tuple[Any, Any]]:
    """("module.qualname", (entry, object)) for an ``add_safe_globals`` entry."""
    if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], str):
        return entry[1], (entry, entry[0])
    module, qualname = getattr(entry, "__module__", None), getattr(entry, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise InvalidArgumentError(
            f"add_safe_globals: {entry!r} has no __module__/__qualname__ to be found by; pass a class or "
            "function, or (object, 'module.name') with the name it is pickled under")
    return f"{module}.{qualname}", (entry, entry)


def add_safe_globals(safe_globals: Iterable[Any]) -> None:
    """Let object collectives unpickle these classes and functions from any peer, also in
    jobs without a token (as ``torch.serialization.add_safe_globals``).

    Each entry is a class or function, or ``(object, "module.name")`` for an object
    pickled under another name.  Register on every rank that receives, before the call.
    Only register types whose unpickling runs no code you would not run for a stranger::

        @dataclass
        class Point: x: int; y: int
        chorus.add_safe_globals([Point])
        chorus.all_gather_object(out, Point(1, 2))     # accepted in a job without a token
    """
    named = [_named(entry) for entry in safe_globals]
    with _lock:
        _registered.update(named)


def get_safe_globals() -> list[Any]:
    """The entries ``add_safe_globals`` registered, as given, oldest first."""
    with _lock:
        return [entry for entry, _ in _registered.values()]


def clear_safe_globals() -> None:
    """Forget every ``add_safe_globals`` registration."""
    with _lock:
        _registered.clear()


def _registered_global(name: str) -> tuple[bool, Any]:
    with _lock:
        entry = _registered.get(name)
    return entry is not None, entry[1] if entry else None


def _storage_from_bytes(data: bytes) -> Any:
    """A tensor's storage from what ``torch.storage._load_from_bytes`` would read, through
    torch's own restricted unpickler."""
    torch = importlib.import_module("torch")
    return torch.load(io.BytesIO(data), weights_only=True)


def _torch_value(name: str) -> Any:
    """``torch.<name>`` if it is a dtype, layout or memory format (``torch.float32``), else None."""
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return None
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


class _Refused(Exception):
    """SafeUnpickler met a global that is not allowed (``args[0]``: "module.name")."""


class SafeUnpickler(pickle.Unpickler):
    """An Unpickler that resolves only allow-listed globals (see the module docstring);
    any other raises _Refused before the global's module is imported."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "__builtin__":  # protocols 0-2 write Python 2's name
            module = "builtins"
        full = f"{module}.{name}"
        found, obj = _registered_global(full)
        if found:
            return obj
        if full in ALLOWED:
            return super().find_class(module, name)
        if full == STORAGE:
            return _storage_from_bytes
        if module == "torch" and "." not in name and name.isidentifier():
            value = _torch_value(name)
            if value is not None:
                return value
        raise _Refused(full)


class ObjectDecoder:
    """Unpickles the objects peers sent to one call of ``op``: with pickle when the peers
    are trusted (see the module docstring's table), else with SafeUnpickler.

    ``authenticated``: whether every peer proved the job token.  The setting is read
    once, when the decoder is made (at the call).
    """

    def __init__(self, op: str, authenticated: bool):
        mode = config.get("CHORUS_OBJECT_PICKLE")
        self.op = op
        self.mode = mode
        self.restricted = mode == "safe" or (mode == "auto" and not authenticated)

    def __call__(self, data, sender: int | None = None) -> Any:
        """``data`` unpickled; UnsafeObjectError if it needs a global that is not allowed."""
        if not self.restricted:
            return pickle.loads(data)
        try:
            return SafeUnpickler(io.BytesIO(data)).load()
        except _Refused as refused:
            name = refused.args[0]
            raise UnsafeObjectError(self.message(name, sender), name, self.op, sender) from None

    def message(self, name: str, sender: int | None) -> str:
        """What was refused, why, and the ways to accept it."""
        who = "a peer" if sender is None else f"rank {sender}"
        if self.mode == "safe":
            why, ways = ("CHORUS_OBJECT_PICKLE=safe", "or, if every rank of the job is trusted, set "
                         "CHORUS_OBJECT_PICKLE=auto with a job token, or CHORUS_OBJECT_PICKLE=full")
        else:
            why = "the job has no token, so any process that reaches its ports could have sent it"
            ways = ("or give the job a token (chorusrun and chorus.spawn make one, jobs on one host derive one "
                    "unless CHORUS_LOCAL_SECRET=off; otherwise set the same CHORUS_TOKEN on every rank), or set "
                    "CHORUS_OBJECT_PICKLE=full to unpickle anything")
        short = name.rpartition(".")[2]
        return (f"{self.op}: refused to unpickle the object sent by {who}: it needs the global {name}, "
                f"which is not on chorus's list of safe globals ({why}; unpickling runs whatever code the "
                f"bytes name). Nothing of it was run. If you trust {name}, register it on every receiving "
                f"rank: chorus.add_safe_globals([{short}]); {ways}")
