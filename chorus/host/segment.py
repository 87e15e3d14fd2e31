"""A POSIX shared-memory file under ``/dev/shm``: create, attach, unlink, sweep.

Lifetime (see ``chorus.shm.handshake``): group rank 0 creates the file and removes its
name at once, before anything else: the other members reach it through rank 0's open
descriptor, ``/proc/<pid>/fd/<n>`` (``Segment.path``; same user, same pid namespace), and
once every member has mapped it rank 0 closes that descriptor (``unlink``).  The memory
lives only in the processes' mappings and disappears with them — after a normal exit,
an exception or ``kill -9`` at any moment alike, whatever launched the job: a kill
while members are still mapping it (milliseconds, each time a group is made) leaves
nothing behind.

A name exists only between the ``open`` that creates it and the ``unlink`` right after
(microseconds).  A process killed inside that can leave a file; files are named
``chorus-<job id>-g<group>-<pid namespace>.<pid>-<random>`` (the creator's pid) so that
``chorusrun`` removes them with :func:`sweep` when the job ends (its janitor,
``chorus.launch.janitor``, does it when ``chorusrun`` itself is SIGKILLed), and so that,
whatever launched the job (torchrun, mp.spawn, by hand), the next segment created on the
host first removes this user's files whose creator is dead (:func:`sweep_dead`).

Why not ``multiprocessing.shared_memory``: before Python 3.13 it registers every
segment with a resource tracker that unlinks it when the process that *opened* it
exits, which breaks ranks that were not forked from one parent; and it has no way to
reserve the pages up front.  Here the file is created with ``O_EXCL`` and mode 0600
(only this user's processes can attach), its pages are reserved with
``posix_fallocate`` (a full ``/dev/shm`` — Docker's default is 64 MiB — fails here,
with an error, instead of killing a rank with SIGBUS in the middle of a collective),
and it is mapped with ``MAP_POPULATE`` so no page fault lands in a collective.
"""

from __future__ import annotations

import glob
import mmap
import os
import re
import secrets
import stat

from chorus import config
from chorus.host.process import pid_alive

SHM_DIR = "/dev/shm"
PREFIX = "chorus-"


def job_tag(job_id: str | None = None) -> str:
    """The job part of segment names: ``CHORUS_JOB_ID`` (sanitised) or ``nojob``."""
    job = (config.get("CHORUS_JOB_ID") or "") if job_id is None else job_id
    return re.sub(r"[^A-Za-z0-9_.]", "_", job)[:64] or "nojob"


class Segment:
    """One mapped shared-memory file.  ``buf`` is the mapping (an ``mmap``)."""

    def __init__(self, path: str, size: int, buf: mmap.mmap, fd: int | None = None):
        self.path = path  # how the members reach it: its creator's descriptor, /proc/<pid>/fd/<n>
        self.size = size
        self.buf = buf
        self._fd = fd  # the creator's descriptor, open until the members have mapped it

    @classmethod
    def create(cls, size: int, group_id: int) -> Segment:
        """Create, size, reserve and map a new file whose name is gone before this returns
        (see the module docstring); on any error nothing is left behind."""
        sweep_dead()
        name = os.path.join(SHM_DIR, f"{PREFIX}{job_tag()}-g{group_id}-{_pid_tag()}-{secrets.token_hex(6)}")
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        _unlink(name)
        try:
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot reserve {size >> 20} MiB in {SHM_DIR} for a "
                                         f"shared-memory window ({exc.strerror}); enlarge {SHM_DIR} "
                                         "(docker run --shm-size=...) or set CHORUS_SHM_BYTES lower") from None
            return cls(f"/proc/{os.getpid()}/fd/{fd}", size, _map(fd, size), fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, path: str, size: int) -> Segment:
        """Map a segment another member of the group created (its ``path``)."""
        if _REOPEN.fullmatch(path) is None:
            raise OSError(f"refusing to attach {path!r}: not a chorus segment's descriptor")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_dev != os.stat(SHM_DIR).st_dev or st.st_size != size
                    or st.st_uid != os.getuid()):
                raise OSError(f"{path}: {st.st_size} bytes owned by uid {st.st_uid}, expected a file of "
                              f"{SHM_DIR} of {size} bytes owned by uid {os.getuid()} (another pid namespace?)")
            return cls(path, size, _map(fd, size))
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """The members have mapped it (or given up): close the descriptor they reached it
        through (the mappings stay valid until every process unmaps)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Unmap now if no view of the mapping is alive; else when the last one dies."""
        self.unlink()
        try:
            self.buf.close()
        except BufferError:
            pass  # numpy views still exist (an op on another thread); the GC unmaps later


def _map(fd: int, size: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pid_namespace() -> int:
    """This process's pid namespace (its inode): a pid means something only inside it."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _pid_tag(pid: int | None = None) -> str:
    return f"{_pid_namespace()}.{os.getpid() if pid is None else pid}"


_CREATOR = re.compile(r"-(\d+)\.(\d+)-[0-9a-f]{12}$")
_REOPEN = re.compile(r"/proc/\d+/fd/\d+")


def sweep_dead() -> list[str]:
    """Remove this user's chorus files in ``/dev/shm`` whose creator has died (a rank
    killed between creating a segment and unlinking it, under any launcher).  Only files
    whose creator's pid belongs to this pid namespace and no longer exists; the members
    that mapped such a file keep their mappings.  Returns the paths removed."""
    removed = []
    ns, uid = str(_pid_namespace()), os.getuid()
    for path in glob.glob(os.path.join(SHM_DIR, f"{PREFIX}*")):
        m = _CREATOR.search(path)
        if m is None or m.group(1) != ns or pid_alive(int(m.group(2))):
            continue
        try:
            if os.lstat(path).st_uid != uid:
                continue
        except FileNotFoundError:
            continue
        _unlink(path)
        removed.append(path)
    return removed


def sweep(job_id: str) -> list[str]:
    """Remove the ``/dev/shm`` files left by job ``job_id`` (a rank killed between creating
    a segment and unlinking it).  Returns the paths removed.  Safe to call at any time
    after the job's ranks are gone; ``chorusrun`` calls it when the job ends."""
    if not job_id:
        return []  # "nojob" names belong to jobs without an id: never sweep those blindly
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"{PREFIX}{glob.escape(job_tag(job_id))}-g*")):
        _unlink(path)
        removed.append(path)
    return removed
