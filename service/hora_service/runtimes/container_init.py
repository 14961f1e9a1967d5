"""Init process of a docker job's container: starts its ranks under the rank shim (control plane).

The docker runtime starts each container with this file as ``python -I container_init.py
RUN_DIR`` (found by its path, so only the standard library is imported); it runs as the container's
PID 1 and reads ``RUN_DIR/container.json``, which the service wrote: ``ranks`` (the ranks this
container runs).

It runs as the container's root, with every capability dropped but ``CAP_SETUID``,
``CAP_SETGID`` and ``CAP_KILL``, under ``no-new-privileges``: the privileged writer of the run
directory, which belongs to the service's account (root on the host, the container's root
here) and which the job's account can read but not write. For each rank it starts ``python -I
-S shim.py RUN_DIR RANK`` in a session of its own with ``rank<R>.log`` as its output, exactly
as the local runtime does on the host; the shim reads the rank's command and account from its
launch file and drops the command to the job's uid and gid before ``exec`` (no capability
survives that), so per-rank logs, pid and exit files, exit codes and signals behave the same,
and no rank can rewrite its log or exit file. A signal the engine delivers (``docker stop``:
SIGTERM) is passed to every rank's process group; as PID 1 it also reaps whatever its ranks
leave orphaned. It exits once every shim has: 0 when every rank succeeded, else the first
failing rank's status. Before it exits it writes ``RUN_DIR/container.hits``: what the
container's cgroup counted (refused forks, OOM kills), since the engine removes that cgroup as
soon as PID 1 is gone, often before the service has read it. Standard library only.
"""

import json
import os
import signal
import subprocess
import sys

SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim.py")
# the names of hora_service.runtimes.paths.JobPaths, spelled again here (standard library
# only); a unit test checks that they agree
CONTAINER_JSON = "container.json"
CONTAINER_HITS = "container.hits"

_shims: dict[int, int] = {}  # shim pid -> rank
_pending: list[int] = []  # signals that came before every shim was started


def _forward(signum: int, frame: object) -> None:
    _pending.append(signum)
    for pid in _shims:
        try:
            os.killpg(pid, signum)  # each shim leads its own session
        except (ProcessLookupError, PermissionError):
            pass


def rank_log(run_dir: str, rank: int) -> str:
    """``RUN_DIR/rank<R>.log``: the rank's log, which its shim's output goes to."""
    return os.path.join(run_dir, f"rank{rank}.log")


def _start(run_dir: str, rank: int) -> int:
    log = rank_log(run_dir, rank)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o640)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", SHIM, run_dir, str(rank)],
            env={},
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        os.close(fd)
    return proc.pid


# what the container's own cgroup counted, as mounted in it (v1: one directory per controller;
# v2: one directory): the hits' name -> (file, key) per layout
_COUNTERS = {
    "pids_max": (("pids/pids.events", "pids.events"), "max"),
    "oom_kills": (("memory/memory.oom_control", "memory.events"), "oom_kill"),
}


def _counter(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _record_hits(run_dir: str, cgroup_root: str = "/sys/fs/cgroup") -> None:
    """Write what the container's cgroup counted to ``RUN_DIR/container.hits`` (JSON)."""
    hits = {
        name: max(_counter(os.path.join(cgroup_root, f), key) for f in files)
        for name, (files, key) in _COUNTERS.items()
    }
    path = os.path.join(run_dir, CONTAINER_HITS)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o640)
        with os.fdopen(fd, "w") as f:
            json.dump(hits, f)
    except OSError:
        pass  # the service then reads the cgroup itself, if it still can


def _status(raw: int) -> int:
    return os.waitstatus_to_exitcode(raw) if raw else 0


def main(argv: list[str]) -> int:
    """Run the ranks of ``argv = [RUN_DIR]``; return the container's exit status."""
    for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(stop, _forward)
    run_dir = argv[0]
    with open(os.path.join(run_dir, CONTAINER_JSON)) as f:
        box = json.load(f)
    for rank in box["ranks"]:
        _shims[_start(run_dir, int(rank))] = int(rank)
    for sig in set(_pending):  # a stop that came while the shims were starting
        _forward(sig, None)
    codes: dict[int, int] = {}
    while len(codes) < len(_shims):
        try:
            pid, raw = os.wait()  # as PID 1, orphans are reaped here too
        except ChildProcessError:
            break
        if pid in _shims:
            codes[_shims[pid]] = _status(raw)
    _record_hits(run_dir)
    failed = [codes[r] for r in sorted(codes) if codes[r] != 0]
    if not failed:
        return 0
    return failed[0] if failed[0] > 0 else 128 - failed[0]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
