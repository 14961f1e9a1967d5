"""Rank shim: runs one rank's command as the job's user and records its pid, output and exit.

Control plane helper, started by the local runtime (and by a docker container's init) as
``python -I -S shim.py RUN_DIR RANK`` in the rank's own session. ``-I -S``
(isolated, no ``site``) makes it ignore ``PYTHON*`` variables and user site directories, so
nothing a job controls can replace its modules; it is started with an empty environment and
reads everything else from ``RUN_DIR/rank<R>.launch``, a JSON file the service wrote and only
the service's account can read:

``command`` (the rank's argument list: it is not on the shim's own command line, which every
account can read in ``/proc``), ``env`` (the command's whole environment), ``uid`` / ``gid``
(the account to run as, or null for the shim's own), ``cgroups`` (directories whose
``cgroup.procs`` the command joins), ``log_limit`` (most bytes ``RUN_DIR/rank<R>.log`` keeps)
and, optionally, ``cwd`` (the command's working directory, entered after the uid is dropped;
else the shim's own), ``umask`` (default ``077``), ``own_tmp`` (a Slurm rank: the shim makes
``$TMPDIR/hora-tmp-rank<R>-XXXXXXXX`` on the node, 0700 and the job's account's, the command's
``TMPDIR``, and removes it, without following links, once the command has ended: a rank that
died by SIGKILL or ``os._exit`` leaves nothing in the node's ``/tmp`` either) and
``namespaces`` (descriptors the shim
inherited of the attempt's network and mount namespaces, see
:mod:`hora_service.runtimes.namespaces`: the command enters them, as root, before it drops
privileges) and ``run_dir_arg`` (an elastic job's driver: the index of the argument naming
its slot file, relative to the run directory; the shim opens ``RUN_DIR`` read-only and the
argument becomes ``/proc/self/fd/N/NAME`` through that descriptor, which the command
inherits, since the job's account cannot reach ``RUN_DIR`` by its path).

Rank 0's command also gets a pipe for the communication preflight's figures: its write end's
descriptor is named in the command's environment as ``HORA_PREFLIGHT_FD=FD:DEV:INO``
(:func:`hora.torch.preflight.publish`), and each line written to it (a JSON document, at
most :data:`FIGURES_MAX` bytes; a longer one is dropped) replaces ``RUN_DIR/preflight.json``,
where the service reads it. The figures never pass through the rank's log, and the job cannot
make that file larger than the bound.

It writes ``rank<R>.pid``, starts the command (which joins the cgroups, clears its
supplementary groups, sets its gid then its uid, then enters ``cwd`` and sets ``umask``
before ``exec``), copies the command's
output into the log (past ``log_limit`` the log keeps its newest half after a truncation
marker), waits for the command, and writes ``rank<R>.exit`` (the exit code; minus the signal
number when killed) before exiting with the same status. The exit file's space is reserved
when the shim starts (``rank<R>.exit.reserve``, renamed at the end), so that a disk that
fills up while the job runs cannot lose how it ended; output that finds the disk full is
dropped (and counted in a note once there is room) rather than ending the shim. Every file
it writes belongs to the service's account and is not writable by the job's, so a job cannot
forge its outcome. The files let a restarted service re-adopt a running rank and learn how a
finished one ended.

Standard library only: this must start in milliseconds. Its signal handlers are its first
statements; a signal in the few milliseconds before them ends the shim before it starts the
command (the monitor then sees the rank gone).
"""

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time

CHUNK = 1 << 16
FIGURES_FILE = "preflight.json"  # JobPaths.preflight
FIGURES_VAR = "HORA_PREFLIGHT_FD"  # hora.contract.RankEnv.preflight_fd
FIGURES_MAX = 256 << 10  # hora.torch.preflight.FIGURES_MAX
DRAIN_S = 0.5  # after the command ends, how long output still in flight is copied
MARK = b"\n[hora: log truncated here: it passed %d bytes; the newest half is kept]\n"


def rank_file(run_dir: str, rank: int, kind: str) -> str:
    """``RUN_DIR/rank<R>.<kind>`` (``log``, ``pid``, ``exit``, ``launch``).

    The names of :class:`hora_service.runtimes.paths.JobPaths`, spelled again here because
    the shim imports only the standard library; a unit test checks that they agree.
    """
    return os.path.join(run_dir, f"rank{rank}.{kind}")


def _write(path: str, text: "str | bytes", mode: int = 0o640) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
    os.replace(tmp, path)


class Figures:
    """The preflight's pipe: each line read from it replaces ``RUN_DIR/preflight.json``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.buf = b""
        self.skip = False  # the line being read is past FIGURES_MAX: dropped to its end

    def feed(self, data: bytes) -> None:
        """Take what the rank wrote; keep each complete line that fits the bound."""
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if not self.skip and len(line) <= FIGURES_MAX:
                try:
                    _write(self.path, line)
                except OSError:  # a full disk: the figures are only shown
                    pass
            self.skip = False
        if len(self.buf) > FIGURES_MAX:
            self.buf, self.skip = b"", True


def _figures_pipe(run_dir: str, rank: int, env: dict) -> "tuple[int, int] | None":
    """Rank 0's preflight pipe (read end, write end), named in ``env``; None for other ranks."""
    if rank != 0:
        return None
    read_end, write_end = os.pipe()
    st = os.fstat(write_end)
    env[FIGURES_VAR] = f"{write_end}:{st.st_dev}:{st.st_ino}"
    return read_end, write_end


_early: list[int] = []  # signals that came before the command existed
_started = False


def _on_signal(signum: int, frame: object) -> None:
    # the service signals the whole process group, so a running command got it too; the
    # shim stays alive to record how the command ends. One that came before the command
    # started is passed on as soon as it has.
    if not _started:
        _early.append(signum)


RESERVE = 32  # bytes set aside for the exit code
TMP_VAR = "TMPDIR"  # hora_service.runtimes.scratch.VAR


def _own_tmp(rank: int, uid: object, gid: object) -> str:
    """A new temporary directory for the command: 0700, the job's account's."""
    base = os.environ.get(TMP_VAR, "")
    base = base if os.path.isabs(base) and os.path.isdir(base) else "/tmp"  # noqa: S108
    path = os.path.join(base, f"hora-tmp-rank{rank}-{os.urandom(4).hex()}")
    os.mkdir(path, 0o700)  # a new name: nothing planted there is followed or reused
    if isinstance(uid, int) and isinstance(gid, int) and os.geteuid() == 0:
        try:
            os.chown(path, uid, gid)
        except OSError:
            os.rmdir(path)
            raise
    return path


def _tmp_for(launch: dict, rank: int, env: dict, log: "Log") -> "str | None":
    """Make the command's own TMPDIR (set in ``env``) when ``launch`` asks for one."""
    if not launch.get("own_tmp"):  # the service asks only when the job's env sets no TMPDIR
        return None
    try:
        env[TMP_VAR] = _own_tmp(rank, launch["uid"], launch["gid"])
    except OSError as e:  # the command still runs, with the node's own TMPDIR
        log.write(f"hora: cannot make a temporary directory for rank {rank}: {e}\n".encode())
        return None
    return str(env[TMP_VAR])


def _remove_tmp(path: "str | None") -> None:
    """Remove the command's temporary directory (a link planted in it is not followed)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: resistant to link races


def _reserve(exit_file: str) -> str | None:
    """Set aside the exit file's space now; None if the disk is already full."""
    path = exit_file + ".reserve"
    try:
        _write(path, " " * RESERVE)
    except OSError:
        return None
    return path


def _record_exit(exit_file: str, code: int, reserved: str | None) -> None:
    """Write the exit file, into the reserved space first (it needs no new blocks)."""
    if reserved is not None:
        try:
            fd = os.open(reserved, os.O_WRONLY)
            try:
                text = str(code).encode()
                os.write(fd, text)
                os.ftruncate(fd, len(text))  # shrinking needs no space
            finally:
                os.close(fd)
            os.replace(reserved, exit_file)
            return
        except OSError:
            pass
    try:
        _write(exit_file, str(code))
    except OSError as e:  # the service falls back on the shim's own exit status
        with contextlib.suppress(OSError):  # unbuffered: nothing is left to fail at exit
            os.write(2, f"hora shim: cannot record exit code {code}: {e}\n".encode())


class Log:
    """The rank's log file, kept under ``limit`` bytes by dropping its oldest half."""

    def __init__(self, path: str, limit: int) -> None:
        self.path, self.limit = path, limit
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self.size = os.fstat(self.fd).st_size
        self.dropped = 0  # bytes lost to a full disk since the last write that landed

    def write(self, data: bytes) -> None:
        """Append ``data``; truncate first when the file would pass the limit.

        A full disk (or another write error) drops the data instead of ending the shim:
        the rank's outcome matters more than its output.
        """
        try:
            if self.dropped:
                note = b"\n[hora: %d bytes of output lost: the disk was full]\n" % self.dropped
                self._append(note)
                self.dropped = 0
            self._append(data)
        except OSError:
            self.dropped += len(data)

    def _append(self, data: bytes) -> None:
        if self.size + len(data) > self.limit:
            self._truncate(data)
            return
        os.write(self.fd, data)
        self.size += len(data)

    def _truncate(self, data: bytes) -> None:
        keep = self.limit // 2  # the newest bytes of the file and data together
        st = os.fstat(self.fd)
        tmp = f"{self.path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        os.fchown(fd, st.st_uid, st.st_gid)
        os.fchmod(fd, st.st_mode & 0o777)
        mark = MARK % self.limit
        os.write(fd, mark)
        from_file = max(0, keep - len(data))
        with open(self.path, "rb") as old:  # copied in chunks: the tail may be large
            old.seek(max(0, self.size - from_file))
            while chunk := old.read(CHUNK):
                os.write(fd, chunk)
        os.write(fd, data[-keep:])
        os.replace(tmp, self.path)
        os.close(self.fd)
        self.fd = fd
        self.size = len(mark) + min(from_file, self.size) + min(len(data), keep)


def _enter(fds: list[int]) -> None:
    """``setns`` into each namespace descriptor (entering a mount namespace resets the cwd)."""
    import ctypes  # only attempts with namespaces pay for it

    libc = ctypes.CDLL(None, use_errno=True)
    for fd in fds:
        if libc.setns(fd, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot enter the attempt's namespaces: {os.strerror(err)}")


def _become(
    uid: object,
    gid: object,
    cgroups: list[str],
    cwd: object = None,
    umask: int = 0o077,
    namespaces: object = (),
) -> None:
    """In the command's process, before exec: join the cgroups, drop privileges, enter ``cwd``.

    USR2 is set ignored, so only a command that installs a handler for it sees it.

    ``cwd`` is entered only once the process is the job's account, so a directory that
    account cannot reach is never entered with the shim's rights: the command ends with
    status 126 and the reason in its log. It sets the job's umask too. The attempt's
    namespaces are entered first, as root; that resets the working directory, so without
    ``cwd`` the shim's own is entered again.
    """
    # USR2 is a warning (Slurm's time limit or preemption, sent up to a minute early): a
    # command that handles it (checkpoints) installs its handler over this; one that does
    # not is not ended by it, since an ignored signal stays ignored across exec
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    pid = str(os.getpid())
    for d in cgroups:
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(pid)
    fds = [int(fd) for fd in namespaces] if isinstance(namespaces, list) else []
    if fds and not isinstance(cwd, str):
        cwd = os.getcwd()
    if fds:
        _enter(fds)
    if isinstance(uid, int) and isinstance(gid, int):
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    os.umask(umask)
    if isinstance(cwd, str):
        try:
            os.chdir(cwd)
        except OSError as e:
            os.write(2, f"hora: cannot enter the working directory {cwd}: {e.strerror}\n".encode())
            os._exit(126)


def _pump(
    child: "subprocess.Popen[bytes]", out: int, log: Log, figures: "tuple[int, Figures] | None"
) -> int:
    """Copy the command's output into the log until it has exited (and a moment more).

    ``figures``: the preflight pipe's read end and where its lines go, read meanwhile.
    """
    code = None
    drain_until = 0.0
    watched = [out] + ([figures[0]] if figures is not None else [])
    while True:
        ready, _, _ = select.select(watched, [], [], 0.2)
        if figures is not None and figures[0] in ready:
            data = os.read(figures[0], CHUNK)
            if data:
                figures[1].feed(data)
            else:
                watched.remove(figures[0])  # every writer has closed it
            continue
        if ready:
            data = os.read(out, CHUNK)
            if data:
                log.write(data)
                continue
            if code is None:
                code = child.wait()
            return code
        if code is None:
            code = child.poll()
            if code is not None:
                drain_until = time.monotonic() + DRAIN_S
        elif time.monotonic() > drain_until:
            return code  # a descendant keeps the pipe open; the service kills it


def main(argv: list[str]) -> int:
    """Run ``argv = [RUN_DIR, RANK]``; return the command's status."""
    global _started
    # USR2 too: Slurm's preemption / time-limit warning reaches the whole process group, and
    # its default action would end the shim before the command could react
    for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
        signal.signal(stop, _on_signal)
    if len(argv) != 2 or not argv[1].isdigit():
        sys.stderr.write("usage: shim.py RUN_DIR RANK\n")
        return 2
    run_dir, rank = argv[0], int(argv[1])
    exit_file = rank_file(run_dir, rank, "exit")
    _write(rank_file(run_dir, rank, "pid"), str(os.getpid()))
    reserved = _reserve(exit_file)
    with open(rank_file(run_dir, rank, "launch")) as f:
        launch = json.load(f)
    command = [str(a) for a in launch["command"]]
    log = Log(rank_file(run_dir, rank, "log"), int(launch["log_limit"]))
    keep: list[int] = []
    at = launch.get("run_dir_arg")
    if isinstance(at, int) and 0 < at < len(command):
        keep.append(os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        command[at] = f"/proc/self/fd/{keep[0]}/{command[at]}"
    env = dict(launch["env"])
    tmp = _tmp_for(launch, rank, env, log)
    sink = _figures_pipe(run_dir, rank, env)
    read_end, write_end = os.pipe()
    try:
        child = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=write_end,
            pass_fds=keep + ([sink[1]] if sink is not None else []),
            preexec_fn=lambda: _become(
                launch["uid"], launch["gid"], launch["cgroups"], launch.get("cwd"),
                int(launch.get("umask", 0o077)), launch.get("namespaces") or [],
            ),
        )
        _started = True
        for sig in _early:
            child.send_signal(sig)
    except (OSError, subprocess.SubprocessError) as e:
        why = getattr(e, "strerror", None) or e
        log.write(f"hora: cannot start {command[0]!r}: {why}\n".encode())
        _record_exit(exit_file, 127, reserved)
        _remove_tmp(tmp)
        return 127
    finally:
        os.close(write_end)
        held = [sink[1]] if sink is not None else []
        for fd in [*(launch.get("namespaces") or []), *keep, *held]:  # the command holds them
            os.close(fd)
    figures = None if sink is None else (sink[0], Figures(os.path.join(run_dir, FIGURES_FILE)))
    code = _pump(child, read_end, log, figures)
    _record_exit(exit_file, code, reserved)
    _remove_tmp(tmp)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
