"""torch's ``init_process_group`` under ``chorusrun``: rendezvous through chorus's store.

``chorusrun`` hosts a *chorus* TCPStore before it starts the ranks
(``CHORUS_STORE_HOSTED=1``, on ``CHORUS_STORE_PORT``; MASTER_PORT is left to torch's own
``env://``, whose rank 0 binds it, for scripts that do not import chorus).  A script
that does import ``chorus.torch`` shares chorus's store instead; ``chorus.torch`` adds:

* an ``chorus://`` init method (public torch API, ``register_rendezvous_handler``):
  chorus's own rendezvous — env variables of chorusrun, torchrun, SLURM, Open MPI or
  PMI, the launcher-hosted store, the job token — handing torch a
  :class:`~chorus.torch.stores.TorchView` of chorus's store;
* under chorusrun only (``CHORUS_STORE_HOSTED=1``), the same for ``env://`` — torch's
  default — so ``dist.init_process_group("chorus")`` (or ``"gloo"``) runs unchanged.
  torch has no public way to replace a handler, so this wraps the entry in
  ``torch.distributed.rendezvous._rendezvous_handlers``; where that is missing (another
  torch version), pass ``init_method="chorus://"``.  Outside chorusrun, ``env://`` is
  torch's own.
"""

from __future__ import annotations

import importlib
import logging
from datetime import timedelta
from urllib.parse import parse_qs, urlsplit

from chorus import config
from chorus.rendezvous import rendezvous
from chorus.torch.stores import TorchView

log = logging.getLogger("chorus")

SCHEME = "chorus"
# torch.distributed.rendezvous is also a function name in torch.distributed: import the module itself
torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")


# The token chorus_handler's rendezvous proved (and its derived secret, chorus.host.secret),
# for the backend's world fabric to prove too: its first taker gets it (take_token).
_handed: list[tuple[bytes, object]] = []


def take_token() -> tuple[bytes, object] | None:
    """(token, derived secret or None) of this process's last ``chorus://`` rendezvous with a
    token, once; None if there is none."""
    return _handed.pop() if _handed else None


# torch keeps only the C++ half of a Python store; once the Python object is collected its
# methods are gone ("pure virtual function") while later new_group calls still use it.
# Stores handed to torch therefore live as long as the process (one per init).
_KEEP: list[TorchView] = []


def under_chorusrun(environ=None) -> bool:
    """Whether a launcher hosts the store (``CHORUS_STORE_HOSTED``, set by chorusrun)."""
    return config.get("CHORUS_STORE_HOSTED", environ)


def chorus_handler(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
    """torch rendezvous handler: yield (torch store, rank, world size) found by chorus."""
    query = parse_qs(urlsplit(url).query)
    rank = int(query.get("rank", ["-1"])[-1])
    world_size = int(query.get("world_size", ["-1"])[-1])
    info = rendezvous("env://", rank, world_size, timeout)
    _handed.clear()
    if info.token is not None:
        _handed.append((info.token, info.secret))
    store = TorchView(info.store)
    store.set_timeout(timeout)
    _KEEP.append(store)
    yield store, info.rank, info.world_size
    raise RuntimeError("chorus:// rendezvous cannot re-rendezvous; restart the job")


def install() -> None:
    """Register ``chorus://`` and route ``env://`` through chorus under chorusrun (idempotent)."""
    handlers = getattr(torch_rendezvous, "_rendezvous_handlers", None)
    if not isinstance(handlers, dict):
        torch_rendezvous.register_rendezvous_handler(SCHEME, chorus_handler)
        log.debug("chorus.torch: cannot wrap torch's env:// handler; use init_method='chorus://'")
        return
    if SCHEME not in handlers:
        torch_rendezvous.register_rendezvous_handler(SCHEME, chorus_handler)
    torch_env = handlers.get("env")
    if torch_env is None or getattr(torch_env, "chorus_wrapped", False):
        return

    def env_handler(url: str, **kwargs):
        return (chorus_handler if under_chorusrun() else torch_env)(url, **kwargs)

    env_handler.chorus_wrapped = True
    handlers["env"] = env_handler
