"""A job secret for jobs on one host that nobody gave a token.

A job with a token (``CHORUS_TOKEN``, ``chorusrun --token-file``; chorusrun on one node
and ``chorus.spawn`` make one) proves it on every store and transport connection.  A job
started without one — single-node torchrun, ``torch.multiprocessing.spawn`` with
``MASTER_ADDR=localhost``, ranks started by hand — gets one here when all its ranks are
on this host: rank 0 draws 32 random bytes and writes them to a file that only this
user can read; the other ranks read the file before they connect, and every connection
then proves the secret exactly as it would prove ``CHORUS_TOKEN`` (so the job counts as
authenticated, also for the object collectives' unpickling)::

    rank 0                                   rank r > 0
      bind the store's port (if it hosts it)   wait for DIR/job-KEY (within the timeout)
      write DIR/job-KEY, mode 0600  ------->   read the secret
      serve; every connection proves it        connect, prove it
      every rank joined: remove the file

One host, decided alike by every rank from what it knows before connecting (in doubt,
no secret, as before): a world of one rank; ``MASTER_ADDR`` a loopback address (127.x,
::1, localhost: no other host can reach it); or the launcher's ``LOCAL_WORLD_SIZE``
(Open MPI's, SLURM's) equal to ``WORLD_SIZE``.  Not for a store a launcher hosts
(chorusrun always gives those jobs a token), nor for file:// or an explicit store.
``CHORUS_LOCAL_SECRET=off`` turns it off; an explicit token always wins.

Where: ``CHORUS_LOCAL_SECRET_DIR``, else ``$XDG_RUNTIME_DIR/chorus``, else
``/tmp/chorus-<uid>`` — a directory of this user's with mode 0700, created so.  One that
is a symlink, belongs to someone else or lets group or others in is refused: no secret
(a warning), and the job runs unauthenticated as before.  KEY hashes what every rank of
the job knows alike: MASTER_ADDR, MASTER_PORT, the world size, TORCHELASTIC_RUN_ID and
TORCHELASTIC_RESTART_COUNT, CHORUS_JOB_ID.  The file is written under a temporary name
created with ``O_EXCL`` and mode 0600, then renamed into place (a reader never sees half
of it); it names its creator (pid namespace, pid, start time), so a reader skips a file
left by a rank that has died, and rank 0 removes files of dead creators, or older than
a day, when it writes one.  Rank 0 removes its file as soon as every rank has connected,
or at exit at the latest.

Other processes of the same user can read the file (as they can read the ranks'
``/proc/PID/environ``, where a ``CHORUS_TOKEN`` lives): the secret keeps out other users
and other hosts, not the job's own user.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import ipaddress
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Mapping

from chorus import config
from chorus.errors import RendezvousError
from chorus.host.process import pid_alive

log = logging.getLogger("chorus")

MAGIC = "chorus-secret 1"
SECRET_BYTES = 32
STALE_AGE_S = 24 * 3600.0  # files older than this are swept whoever made them
TEMP_AGE_S = 60.0  # a temporary file this old belongs to a writer that died
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")

_lock = threading.Lock()
_published: dict[str, bytes] = {}  # files this process wrote and has not removed yet -> their secret
_exit_hook = False


# -- the decision ---------------------------------------------------------------------------

def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (a MASTER_ADDR) names this host's loopback interface, without any
    name lookup: localhost and the 127.0.0.0/8 and ::1 literals."""
    name = addr.strip().strip("[]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def single_host(world_size: int, master_addr: str | None, local_world_size: int | None = None,
                launcher_world_size: int | None = None) -> bool:
    """Whether every rank of the job is on this host, as far as each rank can tell before it
    connects: one rank, a loopback MASTER_ADDR, or the launcher's local world size equal to
    the world size (``local_world_size`` and ``launcher_world_size``: what the launcher's
    variables say, None where they say nothing)."""
    if world_size == 1 or (master_addr is not None and is_loopback(master_addr)):
        return True
    return local_world_size is not None and local_world_size == launcher_world_size == world_size


def job_key(master_addr: str, master_port: int, world_size: int,
            environ: Mapping[str, str] | None = None) -> str:
    """The name every rank of the job gives its secret (32 hex digits).  Not the world
    size: ranks started with different ones must still meet, so that the rendezvous
    tells them so (chorus.rendezvous.agree) instead of each waiting for its own file."""
    env = os.environ if environ is None else environ
    parts = (master_addr.strip().lower(), str(master_port),
             env.get("TORCHELASTIC_RUN_ID", ""), env.get("TORCHELASTIC_RESTART_COUNT", ""),
             config.get("CHORUS_JOB_ID", environ) or "")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def job_secret(rank: int, world_size: int, master_addr: str | None, master_port: int | None,
               timeout: float, *, local_world_size: int | None = None,
               launcher_world_size: int | None = None, environ: Mapping[str, str] | None = None,
               publish: bool = True, what: str = "the job") -> LocalSecret | None:
    """The derived secret of a job without a token, or None where there is none (another
    host may take part, CHORUS_LOCAL_SECRET=off, no master address, the directory refused).

    Rank 0 draws it and (``publish``; else call ``publish()`` itself once its store
    listens) writes it; the other ranks wait up to ``timeout`` seconds for the file and
    raise RendezvousError naming ``what`` they could not connect to if it never comes.
    Call it only when the job has no explicit token; every rank must call it."""
    if config.get("CHORUS_LOCAL_SECRET", environ) == "off" or master_addr is None or master_port is None:
        return None
    if not single_host(world_size, master_addr, local_world_size, launcher_world_size):
        return None
    key = job_key(master_addr, master_port, world_size, environ)
    folder = secret_dir(environ)
    refusal = check_dir(folder, create=rank == 0)
    if refusal is not None:
        log.warning("chorus: not keeping this single-host job's secret in %s: %s (it must be a "
                    "directory of yours with mode 0700, or set CHORUS_LOCAL_SECRET_DIR); the job "
                    "runs without a token", folder, refusal)
        return None
    path = os.path.join(folder, f"job-{key}")
    if rank == 0:
        found = LocalSecret(path, secrets.token_bytes(SECRET_BYTES), creator=True)
        if publish:
            found.publish()
        return found
    return LocalSecret(path, wait_for(path, rank, timeout, what), creator=False)


# -- the directory -------------------------------------------------------------------------

def secret_dir(environ: Mapping[str, str] | None = None) -> str:
    """``CHORUS_LOCAL_SECRET_DIR``, else ``$XDG_RUNTIME_DIR/chorus``, else ``/tmp/chorus-<uid>``."""
    chosen = config.get("CHORUS_LOCAL_SECRET_DIR", environ)
    if chosen:
        return chosen
    runtime = (os.environ if environ is None else environ).get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime) and os.path.isdir(runtime):
        return os.path.join(runtime, "chorus")
    return f"/tmp/chorus-{os.getuid()}"


def check_dir(path: str, create: bool) -> str | None:
    """None if ``path`` is a private directory of this user's, or can become one: rank 0
    (``create``) makes it, with mode 0700, where it is missing; the other ranks accept a
    missing one that rank 0 can make.  Else what is wrong with it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not (os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
            return "it is missing and cannot be created"
        if not create:
            return None  # rank 0 makes it: wait for the file
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            return f"it is missing and cannot be created ({exc.strerror})"
        return check_dir(path, create=False)
    except OSError as exc:
        return f"it cannot be read ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return "it is not a directory (a symlink or a file)"
    if st.st_uid != os.getuid():
        return f"it belongs to uid {st.st_uid}, not to uid {os.getuid()}"
    if st.st_mode & 0o077:
        return f"its mode is {st.st_mode & 0o777:03o}: group or other users may enter it"
    return None


# -- the file -----------------------------------------------------------------------------

class LocalSecret:
    """One job's derived secret: ``token`` (the bytes every connection proves) and the
    file ``path`` that carries it from rank 0 (the ``creator``) to the other ranks."""

    def __init__(self, path: str, token: bytes, creator: bool):
        self.path = path
        self.token = token
        self.creator = creator

    def publish(self) -> None:
        """Rank 0: write the file (0600, renamed into place) and sweep stale ones."""
        if not self.creator:
            return
        folder = os.path.dirname(self.path)
        sweep(folder)
        temp = os.path.join(folder, f".{os.path.basename(self.path)}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            ns, pid, start = _creator()
            os.write(fd, f"{MAGIC} {ns} {pid} {start}\n{self.token.hex()}\n".encode())
            os.close(fd)
            fd = -1
            os.rename(temp, self.path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            _unlink(temp)
            raise
        _remember(self.path, self.token)

    def release(self) -> None:
        """Rank 0: remove the file if it still holds this secret (every rank has read it, or
        the job failed); other ranks: nothing.  Idempotent."""
        if not self.creator:
            return
        with _lock:
            if _published.get(self.path) != self.token:
                return
            del _published[self.path]
        _remove_if_holds(self.path, self.token)


def _creator() -> tuple[int, int, str]:
    return _pid_namespace(), os.getpid(), _start_time(os.getpid())


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> str:
    """The start time of process ``pid`` (clock ticks since boot), "" where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _alive(pid: int, start: str) -> bool:
    # (a process that started at another time has a recycled pid: not the creator)
    return pid_alive(pid) and (not start or _start_time(pid) in ("", start))


def read(path: str) -> tuple[bytes, bool] | None:
    """(secret, whether its creator may still run) from the file at ``path``, or None if
    there is none or it is not one of ours (wrong owner, open to others, malformed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            return None
        text = os.read(fd, 4096).decode("ascii", "replace")
    finally:
        os.close(fd)
    head, _, rest = text.partition("\n")
    fields = head.split(" ")
    try:
        token = bytes.fromhex(rest.strip())
        ns, pid, start = int(fields[2]), int(fields[3]), (fields[4] if len(fields) > 4 else "")
    except (ValueError, IndexError):
        return None
    if not head.startswith(MAGIC + " ") or len(token) != SECRET_BYTES:
        return None
    live = ns != _pid_namespace() or _alive(pid, start)  # a pid of another namespace: cannot tell
    return token, live


def wait_for(path: str, rank: int, timeout: float, what: str) -> bytes:
    """The secret in ``path`` once a live rank 0 has written it; RendezvousError after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        found = read(path)
        if found is not None and found[1]:
            return found[0]
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.05)
    raise RendezvousError(
        f"rank {rank} could not connect to {what}: rank 0 did not write the job secret to {path} "
        f"within {timeout:g}s (a job without a token whose ranks all share a host gets one there: "
        f"MASTER_ADDR is a loopback address or LOCAL_WORLD_SIZE equals WORLD_SIZE); check that rank 0 "
        f"runs on this host as this user with the same MASTER_ADDR/MASTER_PORT, or give every rank the "
        f"same CHORUS_TOKEN, or set CHORUS_LOCAL_SECRET=off on every rank")


def sweep(folder: str) -> list[str]:
    """Remove the secret files in ``folder`` whose creator is dead or that are older than a
    day, and temporary files older than a minute.  Returns the paths removed."""
    removed = []
    now = time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(folder, name)
        try:
            age = now - os.lstat(path).st_mtime
        except OSError:
            continue
        if name.startswith(".job-"):
            stale = age > TEMP_AGE_S
        elif name.startswith("job-"):
            found = read(path)
            stale = age > STALE_AGE_S or (found is not None and not found[1])
        else:
            continue
        if stale:
            _unlink(path)
            removed.append(path)
    return removed


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _remove_if_holds(path: str, token: bytes) -> None:
    found = read(path)
    if found is not None and found[0] == token:  # not a later job's file of the same name
        _unlink(path)


def _remember(path: str, token: bytes) -> None:
    global _exit_hook
    with _lock:
        _published[path] = token
        if not _exit_hook:
            _exit_hook = True
            atexit.register(_remove_all)


def _remove_all() -> None:
    """At exit: the files this process wrote and did not remove yet (a job that failed)."""
    with _lock:
        files = list(_published.items())
        _published.clear()
    for path, token in files:
        _remove_if_holds(path, token)
