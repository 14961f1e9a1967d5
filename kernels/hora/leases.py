"""Machine-wide leases of GPUs and CPU slots: one holder per slot, whatever runs (data plane).

Whatever hands out a slot of this machine holds its **lease** first: an exclusive ``flock``
on the slot's lease file, ``DIR/<kind><index>.lock`` (``gpu0.lock``, ``cpu1.lock``), in the
machine's lease directory (``HORA_LEASE_DIR``; :func:`default_dir`). The hora service holds
the leases of the slots its attempts run on (its rank shims inherit them, so that a restart
of the service does not let them go while the ranks run); a notebook's kernel-local engines
hold theirs (the kernel and each engine). A service or kernel that finds a slot leased does
not hand it out, and says by whom.

An ``flock`` belongs to the open file: it goes when the last descriptor of that file closes,
whichever way its holders end (SIGKILL included), so a dead holder leaves no lease behind
and nothing needs cleaning up.

Who holds a lease: the holder writes its description into the file (one JSON object:
``pid``, ``kind``, ``url``, ``job``, ...). That is only a claim, read without following links
and bounded in size: where the kernel's lock table (``/proc/locks``) can be read, a claim
whose ``locker`` does not hold the lock is set aside and the locking pid is named instead;
the account is that of the process (or of the file's owner), never the claim's word.

The directory is created sticky and world-writable, as ``/tmp`` is (every account's hora
takes part), and its lease files readable by all; in a directory only its owner may write,
they are private to that account. A directory that is a link, is writable by others without
the sticky bit, cannot be written by this account, or belongs to an account other than root or
this one (accepted, when sticky, by accounts other than root) is refused
(:class:`LeaseDirError`, naming the setting). Lease files are opened
with ``O_NOFOLLOW | O_NONBLOCK`` and must be regular files with a single link; another kind of
file there is a slot nobody can take, shown so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import pwd
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hora.errors import HoraError
from hora.kinds import HolderKind

ENV = "HORA_LEASE_DIR"
SHARED_LOCKS = Path("/run/lock")  # the machine's lock directory (tmpfs: empty at boot)
FALLBACK = Path("/tmp")
DIR_NAME = "hora-leases"
SUFFIX = ".lock"
MAX_CLAIM = 4096  # bytes of a description read back
LOCKS = Path("/proc/locks")
_OPEN = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_INTS = ("pid", "locker", "job", "attempt")
_TEXTS = ("kind", "url", "what", "instance")
LockTable = dict[tuple[int, int, int], list[int]]  # (major, minor, inode) -> pids of flocks


class LeaseDirError(HoraError):
    """The lease directory cannot be used safely; ``path`` is it, the message says why."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"the lease directory {path} {why} (setting {ENV})")
        self.path = path


def default_dir(shared: Path = SHARED_LOCKS) -> Path:
    """The machine's lease directory: the same for every account, whoever asks.

    ``/run/lock/hora-leases`` where ``/run/lock`` is a sticky, world-writable lock directory
    (Debian, Ubuntu), else ``/tmp/hora-leases``.

    Example:
        >>> default_dir(Path("/nonexistent"))
        PosixPath('/tmp/hora-leases')
    """
    try:
        mode = os.stat(shared).st_mode
    except OSError:
        mode = 0
    usable = stat.S_ISDIR(mode) and mode & (stat.S_ISVTX | stat.S_IWOTH) == (
        stat.S_ISVTX | stat.S_IWOTH
    )
    return (shared if usable else FALLBACK) / DIR_NAME


def check_dir(st: os.stat_result, euid: int) -> str | None:
    """Why a directory with this ``lstat`` is unsafe for leases (None: it is safe).

    It must be a real directory; writable by others only if sticky; root's or this
    account's, or (for an account other than root) a sticky one another account made.

    Example:
        >>> st = os.stat_result((0o41777, 0, 0, 2, 0, 0, 0, 0, 0, 0))
        >>> check_dir(st, 1000) is None
        True
    """
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(mode):
        return "is not a directory"
    sticky = bool(mode & stat.S_ISVTX)
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
        return "is writable by others but not sticky"
    # another account made the machine's directory first: an account's own hora shares it
    # (that account could break leases there, as it could use the GPUs directly), root does not
    if st.st_uid not in (0, euid) and (euid == 0 or not sticky):
        return f"belongs to {_account(st.st_uid)}, not root or this account; remove it"
    return None


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds a lease, as its file claims and the kernel's lock table confirm.

    Attributes:
        pid: the process to name (a restarted service names itself for the leases its
            ranks kept), else the locking process; None when unknown.
        user: its account (from the process, else the lease file's owner).
        kind: ``service``, ``kernel``, or empty when the claim is unknown.
        url: a service's URL; job, attempt: what a service runs on the slot.
        what: a kernel's notebook; or why nobody can take the slot (``problem``).
        instance: a service's data directory, hashed.
        locker: the pid that took the lock; alive: whether ``pid`` still runs.
        file_uid: the lease file's owner.
        problem: the lease file itself is unusable (not a regular file, ...).
        since: when the holder took or last described it (UNIX time; its claim).
    """

    pid: int | None = None
    user: str | None = None
    kind: str = ""
    url: str | None = None
    job: int | None = None
    attempt: int | None = None
    what: str | None = None
    instance: str | None = None
    locker: int | None = None
    alive: bool = True
    file_uid: int | None = None
    problem: str | None = None
    since: float | None = None

    def words(self) -> str:
        """Who, for people: ``hora service pid 42 at http://... (job 7, user ann)``.

        Example:
            >>> LeaseHolder(pid=9, user="ann", kind="kernel", what="a.ipynb").words()
            'notebook kernel pid 9 (a.ipynb, user ann)'
        """
        if self.problem is not None:
            return f"nobody: {self.problem}"
        service, kernel = self.kind == HolderKind.service, self.kind == HolderKind.kernel
        if service:
            head = f"hora service pid {self.pid}" + (f" at {self.url}" if self.url else "")
        elif kernel:
            head = f"notebook kernel pid {self.pid}"
        else:
            head = f"pid {self.pid}" if self.pid is not None else "an unknown process"
        more = [f"job {self.job}"] if service and self.job is not None else []
        more += [self.what] if kernel and self.what else []
        more += [f"user {self.user}"] if self.user else []
        more += [] if self.alive else ["not running: processes it started hold the lease"]
        return head + (f" ({', '.join(more)})" if more else "")


class Lease:
    """A lease held through one open file; it goes when the last descriptor of it closes.

    Passing :meth:`fileno` to a child process (``pass_fds``) makes the child a holder too.
    """

    def __init__(self, name: str, fd: int, writable: bool) -> None:
        self.name = name
        self._fd = fd
        self._writable = writable

    def fileno(self) -> int:
        """The open lease file (inheritable only through ``pass_fds``)."""
        return self._fd

    def describe(self, claims: Mapping[str, object]) -> None:
        """Write who holds it (``pid`` and ``locker`` default to this process)."""
        if self._writable and self._fd >= 0:
            _write_claims(self._fd, claims)

    def close(self) -> None:
        """Let go of this descriptor (the lease ends once no child holds it either)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # a lease nobody closed goes with its object, as a file does
        with contextlib.suppress(OSError):
            self.close()


class LeaseDir:
    """The machine's lease directory: take a slot's lease, or see who holds it.

    Args:
        path: the directory (:meth:`from_environ` for the setting or the default).

    Example:
        >>> import tempfile
        >>> leases = LeaseDir(Path(tempfile.mkdtemp()))
        >>> lease = leases.take("cpu0", {"kind": "kernel"})
        >>> leases.held(["cpu0", "cpu1"])["cpu0"].kind, "cpu1" in leases.held(["cpu1"])
        ('kernel', False)
        >>> lease.close(); leases.held(["cpu0"])
        {}
    """

    def __init__(self, path: Path, locks: Path = LOCKS) -> None:
        self.path = path
        self._locks = locks  # the kernel's lock table (tests point it elsewhere)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LeaseDir:
        """The directory ``HORA_LEASE_DIR`` names, else :func:`default_dir`."""
        value = (os.environ if environ is None else environ).get(ENV, "").strip()
        return cls(Path(value).expanduser() if value else default_dir())

    def ready(self) -> None:
        """Make the directory (sticky, world-writable) if missing; check that it is safe.

        Raises:
            LeaseDirError: it cannot be made, or is not safe (see the module docstring).
        """
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise LeaseDirError(self.path, f"cannot be made: {e.strerror}") from None
        else:
            os.chmod(self.path, 0o1777)  # made here: every account's hora takes part
        try:
            st = os.lstat(self.path)
        except OSError as e:
            raise LeaseDirError(self.path, f"cannot be read: {e.strerror}") from None
        why = check_dir(st, os.geteuid())
        if why is None and not os.access(self.path, os.W_OK | os.X_OK):
            why = "cannot be written by this account"
        if why is not None:
            raise LeaseDirError(self.path, why)

    def file(self, name: str) -> Path:
        """The lease file of ``name`` (``cpu0`` -> ``DIR/cpu0.lock``)."""
        return self.path / f"{name}{SUFFIX}"

    def take(self, name: str, claims: Mapping[str, object]) -> Lease | LeaseHolder:
        """Take the lease of ``name`` now, or say who holds it (never waits).

        Args:
            name: the slot (``gpu0``, ``cpu3``).
            claims: the description to write (``kind``, ``url``, ``job``, ...).

        Returns:
            The lease, or its holder when another open file of it holds the lock.
        """
        try:
            fd, writable = _open_lease(self.file(name))
        except _Unusable as e:
            return LeaseHolder(problem=str(e))
        except OSError as e:
            return LeaseHolder(problem=f"{self.file(name)} cannot be opened: {e.strerror}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                return _holder(fd, _lock_table(self._locks))
            finally:
                os.close(fd)
        lease = Lease(name, fd, writable)
        lease.describe(claims)
        return lease

    def held(self, names: Iterable[str]) -> dict[str, LeaseHolder]:
        """Who holds each of ``names`` that someone holds (a free one is left out).

        Reads the kernel's lock table, so that looking takes no lock; where it cannot be
        read, each lease is tried and let go at once.
        """
        names = list(names)
        if not names:  # nothing to look at: the lock table is not read (a few ms on some VMs)
            return {}
        table = _lock_table(self._locks)
        out: dict[str, LeaseHolder] = {}
        for name in names:
            try:
                fd = os.open(self.file(name), os.O_RDONLY | _OPEN)
            except FileNotFoundError:
                continue
            except OSError as e:
                out[name] = LeaseHolder(problem=f"{self.file(name)}: {_why(e)}")
                continue
            try:
                found = _look(fd, table, self.file(name))
            finally:
                os.close(fd)
            if found is not None:
                out[name] = found
        return out

    def redescribe(self, name: str, claims: Mapping[str, object]) -> bool:
        """Rewrite the description of a lease this account's processes hold; True if done.

        A restarted service names itself on the leases its earlier run's ranks still hold
        (``locker`` stays the pid that took the lock).
        """
        try:
            fd, writable = _open_lease(self.file(name), create=False)
        except (OSError, _Unusable):
            return False
        try:
            if not writable or os.fstat(fd).st_uid != os.geteuid():
                return False
            _write_claims(fd, claims)
            return True
        finally:
            os.close(fd)


class _Unusable(Exception):
    """A lease file that is not a regular file with one link."""


def _why(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "is a symbolic link"
    return e.strerror or str(e)


def _open_lease(path: Path, create: bool = True) -> tuple[int, bool]:
    """Open a lease file without following links or blocking; ``(fd, writable)``."""
    for _ in range(3):
        writable = True
        try:
            fd = os.open(path, os.O_RDWR | _OPEN)
        except PermissionError:  # another account's file: the lock needs only reading
            fd, writable = os.open(path, os.O_RDONLY | _OPEN), False
        except FileNotFoundError:
            if not create:
                raise
            mode = _file_mode(path.parent)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN, mode)
            except FileExistsError:
                continue  # made meanwhile by another: open that one
            os.fchmod(fd, mode)  # whatever the umask
        except OSError as e:
            raise _Unusable(f"{path} {_why(e)}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            raise _Unusable(f"{path} is not a regular file with a single link; remove it")
        return fd, writable
    raise _Unusable(f"{path} keeps changing")


def _file_mode(directory: Path) -> int:
    """A new lease file's mode: open to every account's hora in a world-writable directory.

    In a directory only its owner may write, the file is that account's alone.
    """
    try:
        shared = os.stat(directory).st_mode & stat.S_IWOTH
    except OSError:
        shared = 0
    return 0o644 if shared else 0o600


def _write_claims(fd: int, claims: Mapping[str, object]) -> None:
    me = os.getpid()
    body = {"pid": me, "locker": me, "since": time.time(), **claims}
    data = json.dumps(body, sort_keys=True).encode()[:MAX_CLAIM]
    with contextlib.suppress(OSError):  # a full disk: the lease holds, unnamed
        os.ftruncate(fd, 0)
        os.pwrite(fd, data + b"\n", 0)


def _lock_table(path: Path = LOCKS) -> LockTable | None:
    """``(major, minor, inode) -> pids`` of every flock on the machine; None if unreadable."""
    try:
        text = path.read_text()
    except OSError:
        return None
    table: LockTable = {}
    for line in text.splitlines():
        cols = line.split()
        if len(cols) < 6 or cols[1] != "FLOCK":  # "->" rows wait for a lock; POSIX rows
            continue
        try:
            major, minor, inode = cols[5].split(":")
            key = (int(major, 16), int(minor, 16), int(inode))
            table.setdefault(key, []).append(int(cols[4]))
        except ValueError:
            continue
    return table


def _look(fd: int, table: LockTable | None, path: Path) -> LeaseHolder | None:
    """The holder of an open lease file, None if nobody holds it."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return LeaseHolder(problem=f"{path} is not a regular file with a single link; remove it")
    if table is not None:
        if not table.get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)):
            return None
        return _holder(fd, table)
    try:  # no lock table: try the lock, and let it go at once
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _holder(fd, None)
    fcntl.flock(fd, fcntl.LOCK_UN)
    return None


def _holder(fd: int, table: LockTable | None) -> LeaseHolder:
    """Who holds the lock on ``fd``: its claim, checked against the lock table."""
    st = os.fstat(fd)
    claims = _claims(fd)
    lockers = (table or {}).get((os.major(st.st_dev), os.minor(st.st_dev), st.st_ino), [])
    visible = [p for p in lockers if p > 0]
    if visible and claims.get("locker") not in visible:
        claims = {"pid": visible[0], "locker": visible[0]}  # a stale or false claim
    pid = claims.get("pid")
    pid = pid if isinstance(pid, int) else None
    alive = pid is not None and _alive(pid)
    uid = _uid_of(pid) if alive and pid is not None else st.st_uid
    return LeaseHolder(
        pid=pid, user=_account(uid), kind=str(claims.get("kind") or ""),
        url=_text(claims.get("url")), job=_int(claims.get("job")),
        attempt=_int(claims.get("attempt")), what=_text(claims.get("what")),
        instance=_text(claims.get("instance")), locker=_int(claims.get("locker")),
        alive=alive, file_uid=st.st_uid, since=_float(claims.get("since")),
    )  # fmt: skip


def _claims(fd: int) -> dict[str, object]:
    """The description in a lease file: known keys of the right types only."""
    try:
        raw = json.loads(os.pread(fd, MAX_CLAIM, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict[str, object] = {k: raw[k] for k in _INTS if _int(raw.get(k)) is not None}
    out.update({k: raw[k] for k in _TEXTS if _text(raw.get(k)) is not None})
    if isinstance(raw.get("since"), float | int) and not isinstance(raw["since"], bool):
        out["since"] = float(raw["since"])
    return out


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _float(v: object) -> float | None:
    return float(v) if isinstance(v, float | int) and not isinstance(v, bool) else None


def _text(v: object) -> str | None:
    return v[:200] if isinstance(v, str) and v.isprintable() else None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


@functools.lru_cache(maxsize=256)
def _account(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"
