"""Namespace holder: creates and keeps one attempt's network and mount namespaces.

Control plane helper, started by the local runtime (as root) as
``python -I -S nsholder.py`` with a JSON object on its stdin:

``cgroups`` (directories whose ``cgroup.procs`` it joins first, so the attempt's cgroup
holds it and it dies with the attempt), ``keep`` (directories under ``/tmp``, ``/var/tmp``
or ``/dev/shm`` the job needs, such as its working directory: they stay visible at the same
path; each is opened component by component with ``O_NOFOLLOW``, so a symlink planted on
the way is never followed as root, and one that cannot be opened so is left out),
``hidepid`` (whether to mount ``/proc`` with ``hidepid=invisible``) and ``tmp_bytes`` (the
size of each tmpfs; null: the kernel's default).

It then unshares a network namespace (only a loopback, brought up here) and a mount
namespace with private propagation, mounts a fresh tmpfs on ``/tmp``, ``/var/tmp`` and
``/dev/shm`` (bind-mounting the ``keep`` directories back at their paths) and, with
``hidepid``, a ``/proc`` of its own where an account sees only its own processes. It writes
``ready`` (or ``error: ...``) on stdout and sleeps until it is killed, which the service
does once every rank's shim holds descriptors of both namespaces (each shim enters them,
``setns``, before it drops privileges); when the last rank is gone, the namespaces and their
tmpfs vanish with it.

Standard library and ctypes only, like the shim.
"""

import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, fstype: "str | None", flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def _loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sh22x", b"lo", 0)
        flags = struct.unpack("16sh22x", fcntl.ioctl(s, SIOCGIFFLAGS, ifr))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", flags | IFF_UP))


def _under_private(path: str) -> bool:
    return any(path == d or path.startswith(d + "/") for d in PRIVATE_DIRS)


def _bound_under(path: str, kept: "list[str]") -> bool:
    """Whether a parent of ``path`` was bound already (its bind mount shows ``path`` too)."""
    return any(path.startswith(k + "/") for k in kept if k != path)


def _open_real(path: str) -> "int | None":
    """An ``O_PATH`` descriptor of directory ``path`` reached through real directories only.

    None when a component is a symlink, missing or not a directory.
    """
    parts = [p for p in path.split("/") if p]
    if ".." in parts:
        return None
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
    try:
        for part in parts:
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError:
        os.close(fd)
        return None
    return fd


def _private_mounts(keep: "list[str]", size: "int | None") -> None:
    """Fresh tmpfs on the private dirs (of ``size`` bytes each); ``keep`` bound back in place."""
    opened = [(p, _open_real(p)) for p in keep if _under_private(p)]
    held = [(p, fd) for p, fd in opened if fd is not None]
    options = "mode=1777" + (f",size={int(size)}" if size else "")
    for d in PRIVATE_DIRS:
        if os.path.isdir(d):
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, options)
    kept = [path for path, _ in held]
    for path, fd in held:
        if not _bound_under(path, kept):
            os.makedirs(path, 0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)


def setup(config: "dict[str, list[str] | bool | int | None]") -> None:
    """Join the cgroups, unshare, and build the private network and mounts."""
    pid = str(os.getpid())
    cgroups, keep = config.get("cgroups"), config.get("keep")
    for d in cgroups if isinstance(cgroups, list) else []:
        with open(os.path.join(str(d), "cgroup.procs"), "w") as f:
            f.write(pid)
    _check(_libc.unshare(CLONE_NEWNET | CLONE_NEWNS), "unshare")
    _mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here leaks out
    _loopback_up()
    size = config.get("tmp_bytes")
    _private_mounts(
        [str(p) for p in keep] if isinstance(keep, list) else [],
        size if isinstance(size, int) and not isinstance(size, bool) else None,
    )
    if config.get("hidepid"):
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")


def main() -> int:
    """Set up from the JSON on stdin, say ``ready``, then hold the namespaces until killed."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        setup(json.loads(sys.stdin.read() or "{}"))
    except (OSError, ValueError) as e:
        os.write(1, f"error: {e}\n".encode())
        return 1
    os.write(1, b"ready\n")
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # let go of the service's pipes
        os.dup2(devnull, fd)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
