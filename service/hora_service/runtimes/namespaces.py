"""One attempt's own network and mount namespaces in the local runtime (control plane).

Like a Kubernetes pod's network namespace and systemd's ``PrivateTmp=``, each attempt of a
job in multi-user mode gets, on its host:

* a **network namespace** with only a loopback, shared by its ranks: its rendezvous store and
  its gloo / NCCL listeners cannot be reached from any other process, whoever runs it (torch's
  ``TCPStore`` has no authentication: before this, another user's job found the port in
  ``/proc/net/tcp`` and joined the world). ``torchrun``, ``mpirun`` and ``hora run`` started
  inside the job meet on that loopback as before;
* a **mount namespace** with a fresh tmpfs on ``/tmp``, ``/var/tmp`` and ``/dev/shm``, each
  of at most ``job_disk_limit`` (what a job leaves there vanishes with it, no other job sees
  it meanwhile, and it cannot fill the host's disk) and a ``/proc`` mounted with
  ``hidepid=invisible`` (a job sees only its own account's processes; kernel 5.8 or later,
  where each ``/proc`` mount has options of its own).

A small holder process (:mod:`hora_service.runtimes.nsholder`, joined to the attempt's
cgroup and carrying its tag) creates the namespaces; the service passes descriptors of them
to each rank's shim (:func:`fds_of`, named in its launch file), which enters them before
dropping privileges.
Once every rank's shim is started it holds its own descriptors, which keep the namespaces
(and the tmpfs in them) alive, and the holder is ended: nothing of the attempt but its ranks
is left running, whether or not a service is there when they end. Where this is impossible
(the service is not root, the kernel refuses), the attempt runs without, after one warning;
its rendezvous store still answers only holders of the attempt's secret
(:mod:`hora.torch._authstore`).
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hora_service.runtimes.base import AttemptPlan
from hora_service.runtimes.containment import TAG_VAR

log = logging.getLogger(__name__)

HOLDER = Path(__file__).with_name("nsholder.py")
READY_WAIT_S = 10.0
KINDS = ("net", "mnt")  # the order the shim enters them in
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # what the holder mounts (nsholder.PRIVATE_DIRS)


def hidepid_supported(release: str | None = None) -> bool:
    """Whether each ``/proc`` mount has its own ``hidepid`` (Linux 5.8 and later).

    Before 5.8 the option belonged to the pid namespace's one ``/proc``: setting it for a
    job would set it for the whole machine.

    Example:
        >>> hidepid_supported("5.8.0"), hidepid_supported("5.4.0-150-generic")
        (True, False)
    """
    release = os.uname().release if release is None else release
    try:
        major, minor = (int(x) for x in release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 8)


def given_paths(env: Mapping[str, str], program: str | None) -> tuple[str, ...]:
    """Directories under the private ``/tmp``, ``/var/tmp`` or ``/dev/shm`` a job was given.

    The absolute entries of its ``PATH`` and ``PYTHONPATH``, its ``VIRTUAL_ENV`` and
    ``CONDA_PREFIX``, and the directory of an absolute program; a ``bin`` directory with its
    parent (the prefix of a venv or conda environment, where its ``lib`` and
    ``pyvenv.cfg`` are). Never ``/tmp`` or ``/dev/shm`` themselves. The start check keeps those
    the job's account reaches (:mod:`hora_service.runtimes.startcheck`).

    Example:
        >>> given_paths({"PATH": "/tmp/v/bin:/usr/bin", "PYTHONPATH": "/tmp/src"}, None)
        ('/tmp/src', '/tmp/v', '/tmp/v/bin')
    """
    found = [p for name in ("PATH", "PYTHONPATH") for p in env.get(name, "").split(os.pathsep)]
    found += [env.get("VIRTUAL_ENV", ""), env.get("CONDA_PREFIX", "")]
    if program is not None and program.startswith("/"):
        found.append(os.path.dirname(program))
    out: set[str] = set()
    for path in (os.path.normpath(p) for p in found if p.startswith("/")):
        out.add(path)
        if os.path.basename(path) == "bin":
            out.add(os.path.dirname(path))
    return tuple(sorted(p for p in out if _below_private(p)))


def _below_private(path: str) -> bool:
    """Whether ``path`` lies strictly below ``/tmp``, ``/var/tmp`` or ``/dev/shm``."""
    return any(path.startswith(d + "/") for d in PRIVATE_DIRS)


def holder_config(plan: AttemptPlan, release: str | None = None) -> dict[str, object]:
    """What the holder reads on its stdin: cgroups to join, paths to keep, ``hidepid``, size.

    ``tmp_bytes`` is the size of each private ``/tmp``, ``/var/tmp`` and ``/dev/shm``
    (None: the kernel's default).

    The work root, the working directory and ``plan.tmp_paths`` (what of ``job_tmp_paths``
    and of the directories the job was given its account reaches) stay visible at their
    paths when they lie under ``/tmp``, ``/var/tmp`` or ``/dev/shm`` (their own modes keep
    users' directories apart); nothing else of the host's ``/tmp`` does. The holder binds
    each through real directories only, never through a symlink.

    Example:
        >>> holder_config(plan)["keep"]  # doctest: +SKIP
        ['/tmp/work/alice']
    """
    cgroups = [str(d) for d in plan.container.dirs] if plan.container is not None else []
    keep = {str(plan.workdir)} | {str(p) for p in plan.tmp_paths}
    if plan.work_root is not None:
        keep.add(str(plan.work_root))
    return {
        "cgroups": cgroups,
        "keep": sorted(keep, key=len),  # a parent first: its bind mount holds the child's path
        "hidepid": hidepid_supported(release),
        "tmp_bytes": plan.tmp_bytes,
    }


def holder_argv(python: str = sys.executable) -> list[str]:
    """The holder's argument list (its configuration comes on stdin, never here).

    Example:
        >>> holder_argv("/usr/bin/python3")[:3]
        ['/usr/bin/python3', '-I', '-S']
    """
    return [python, "-I", "-S", str(HOLDER)]


def wanted(plan: AttemptPlan) -> bool:
    """Whether the local runtime gives ``plan`` namespaces.

    Only a job (not a session) run as a job account, with ``job_private_network`` on.
    """
    return plan.private_network and plan.run_as is not None


@dataclass
class Holder:
    """A running holder and descriptors of its namespaces (``net``, then ``mnt``)."""

    proc: subprocess.Popen[bytes]
    fds: tuple[int, ...]

    def close_fds(self) -> None:
        """Close the service's descriptors (the ranks' shims hold their own)."""
        for fd in self.fds:
            os.close(fd)
        self.fds = ()

    def stop(self) -> None:
        """Kill the holder and reap it (the ranks' descriptors keep the namespaces)."""
        self.close_fds()
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.warning("namespace holder %d did not exit after SIGKILL", self.proc.pid)


def start(plan: AttemptPlan) -> Holder | None:
    """Start the attempt's holder; None (after a warning) where namespaces are impossible."""
    if os.geteuid() != 0:
        _warn(plan, "the service is not root")
        return None
    proc = subprocess.Popen(
        holder_argv(),
        env={TAG_VAR: plan.container.tag} if plan.container is not None else {},
        cwd="/",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(holder_config(plan)).encode())
        proc.stdin.close()
        answer = _read_line(proc.stdout.fileno(), READY_WAIT_S)
        if answer != "ready":
            raise OSError(answer or f"no answer within {READY_WAIT_S:g} s")
        fds = tuple(os.open(f"/proc/{proc.pid}/ns/{kind}", os.O_RDONLY) for kind in KINDS)
    except OSError as e:
        proc.kill()
        proc.wait()
        _warn(plan, str(e))
        return None
    finally:
        proc.stdout.close()
    return Holder(proc, fds)


def fds_of(holder: Holder | None) -> tuple[int, ...]:
    """The descriptors a rank's shim ``setns`` into (none without a holder)."""
    return tuple(holder.fds) if holder is not None else ()


def _read_line(fd: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 256)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


_warned: set[str] = set()


def _warn(plan: AttemptPlan, why: str) -> None:
    """Say once per reason that attempts run without their own namespaces."""
    if why not in _warned:
        _warned.add(why)
        log.warning(
            "job %d attempt %d: no private network namespace, /tmp or /proc (%s): its "
            "sockets are reachable from this host (its rendezvous stays sealed by its "
            "secret); further attempts that fail alike are not reported",
            plan.job_id,
            plan.attempt,
            why,
        )
