"""Parse ``hora run`` arguments into a :class:`LaunchConfig` and build each rank's environment.

Data plane, pure: nothing here starts a process or reads ``os.environ``. The command line is
validated once, at the edge (:func:`parse_args`), into a frozen :class:`LaunchConfig`; the
supervisor (:mod:`hora.launch.launcher`) receives that typed object and the per-rank
environments from :func:`build_rank_envs`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hora.env import (
    LAUNCHER_VARS,
    TORCHRUN_DEFAULTS,
    RankEnv,
    layered_env,
    new_rdzv_secret,
    rank_env,
)
from hora.errors import SpecError

PROG = "hora run"
BACKENDS = ("gloo", "nccl")
DEFAULT_GRACE_S = 5.0
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "localhost.localdomain"}


@dataclass(frozen=True)
class ElasticConfig:
    """The elastic part of a ``hora run`` (any of ``--min-np``, ``--max-np``, discovery).

    Attributes:
        min_np: fewer live workers than this: the others wait (``timeout``) for capacity.
        max_np: never more workers than this.
        discovery: the host discovery script as an argument list, or None (this machine's
            slots: ``-H localhost:S``, else ``-np``).
        slots: the slots of this machine when there is no discovery script.
        reset_limit: stop the job after this many re-formed worlds (None: no limit).
        timeout: seconds the workers may wait below ``min_np`` (``HORA_ELASTIC_TIMEOUT``).
        cooldown: the blacklist's cool-down range in seconds (low, high).
        blacklist_threshold: failures of a host's workers within a minute that blacklist it.
        host_file: a file of ``host:slots`` lines the driver re-reads every second (what a
            discovery script would print; the hora service rewrites it as it grants slots).
        report: print every generation as one ``membership {json}`` line on stderr
            (:func:`hora.launch.elastic_rdzv.membership_line`; the service reads them).
    """

    min_np: int
    max_np: int
    discovery: tuple[str, ...] | None = None
    slots: int = 1
    reset_limit: int | None = None
    timeout: float = 600.0
    cooldown: tuple[float, float] = (10.0, 300.0)
    blacklist_threshold: int = 3
    host_file: Path | None = None
    report: bool = False


@dataclass(frozen=True)
class LaunchConfig:
    """One validated ``hora run`` invocation.

    Attributes:
        np: number of ranks to start.
        command: the program and its arguments, run once per rank.
        timeline_filename: absolute path of the merged Chrome-trace file, or None.
        start_timeout: seconds for the rendezvous and each collective (``HORA_TIMEOUT``), or
            None to keep hora.torch's default.
        master_port: rendezvous port, or None to pick a free one at launch.
        master_addr: rendezvous address (one machine: the loopback address).
        backend: ``gloo`` or ``nccl``, or None to let ``hvd.init()`` choose.
        grace_period: seconds between SIGTERM and SIGKILL when ranks are stopped.
        elastic: the elastic settings, or None for a fixed world.
    """

    np: int
    command: tuple[str, ...]
    timeline_filename: Path | None = None
    start_timeout: float | None = None
    master_port: int | None = None
    master_addr: str = "127.0.0.1"
    backend: str | None = None
    grace_period: float = DEFAULT_GRACE_S
    elastic: ElasticConfig | None = None


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`SpecError` instead of exiting the process."""

    def error(self, message: str) -> None:  # type: ignore[override]
        head, sep, rest = message.partition(": ")
        if head.startswith("argument "):
            raise SpecError(head.removeprefix("argument ").split("/")[0], rest)
        if head == "unrecognized arguments":
            raise SpecError(rest.split()[0], "unknown option (put the command after --)")
        raise SpecError("arguments", message)


def make_parser() -> argparse.ArgumentParser:
    """Return the ``hora run`` argument parser (used for parsing and for ``--help``).

    Returns:
        An :class:`argparse.ArgumentParser` whose errors raise :class:`SpecError`.

    Example:
        >>> make_parser().prog
        'hora run'
    """
    p = _Parser(
        prog=PROG, allow_abbrev=False,
        usage="%(prog)s -np N [options] [--] COMMAND [ARGS...]",
        description="Start N local ranks of a training script (like horovodrun / torchrun).",
        epilog="Each output line is prefixed with its rank: [1]<stdout>:... / [1]<stderr>:...",
    )
    p.add_argument("-np", "--num-proc", "--nproc-per-node", "--nproc_per_node", dest="np",
                   type=str, default=None, metavar="N", help="number of ranks to start")
    p.add_argument("-H", "--hosts", default=None, metavar="HOSTS",
                   help="only localhost[:slots] for now, e.g. localhost:4 (multi-host comes later)")
    p.add_argument("--timeline-filename", default=None, metavar="F",
                   help="write one Chrome-trace JSON of every rank's collectives to F")
    p.add_argument("--start-timeout", default=None, metavar="S",
                   help="seconds for the rendezvous and for each collective (HORA_TIMEOUT)")
    p.add_argument("--master-port", default=None, metavar="P",
                   help="rendezvous port on 127.0.0.1 (default: a free port)")
    p.add_argument("--backend", default=None, metavar="{gloo,nccl}",
                   help="torch.distributed backend (default: nccl with CUDA, else gloo)")
    p.add_argument("--grace-period", default=str(DEFAULT_GRACE_S), metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default 5)")
    e = p.add_argument_group("elastic training (hvd.elastic.run; any of these makes it elastic)")
    e.add_argument("--min-np", default=None, metavar="A",
                   help="below A live workers, the others wait for capacity (default: -np)")
    e.add_argument("--max-np", default=None, metavar="B",
                   help="at most B workers; more slots grow the world at the next commit")
    e.add_argument("--host-discovery-script", default=None, metavar="S",
                   help="executable printing one host:slots per line (run every second)")
    e.add_argument("--host-file", default=None, metavar="F",
                   help="file of host:slots lines, re-read every second (instead of a script)")
    e.add_argument("--report-membership", action="store_true",
                   help="print each world's members as one 'membership {json}' line on stderr")
    e.add_argument("--reset-limit", default=None, metavar="K",
                   help="stop after K re-formed worlds (default: no limit)")
    e.add_argument("--elastic-timeout", default="600", metavar="S",
                   help="seconds workers wait below --min-np before the job fails (default 600)")
    e.add_argument("--blacklist-cooldown-range", nargs=2, default=("10", "300"),
                   metavar=("LOW", "HIGH"),
                   help="a failing host stays out LOW s, doubling up to HIGH (default 10 300)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program to run on each rank")
    return p


def _number(flag: str, raw: str, kind: type[int] | type[float], low: float, high: float) -> float:
    try:
        value = kind(raw)
    except ValueError:
        raise SpecError(flag, f"expected {'an integer' if kind is int else 'a number'}, "
                        f"got {raw!r}") from None
    if not low <= value <= high:
        raise SpecError(flag, f"must be between {low:g} and {high:g}, got {raw}")
    return value


def parse_hosts(hosts: str, local_names: Sequence[str] = ()) -> int:
    """Return the number of slots a ``-H`` value gives on this machine.

    Args:
        hosts: ``host[:slots][,host[:slots]...]``; every host must be this machine.
        local_names: extra names that mean this machine (its hostname).

    Returns:
        The total number of slots (a host without ``:slots`` counts one).

    Raises:
        SpecError: for a remote host (multi-host comes later) or a bad slot count.

    Example:
        >>> parse_hosts("localhost:4")
        4
    """
    local = _LOCAL_HOSTS | set(local_names)
    total = 0
    for item in filter(None, (h.strip() for h in hosts.split(","))):
        name, _, slots = item.rpartition(":") if ":" in item else (item, "", "1")
        if name not in local:
            raise SpecError("--hosts", f"host {name!r} is not this machine: hora run starts ranks "
                            "on localhost only for now (multi-host comes later)")
        total += int(_number("--hosts", slots, int, 1, 4096))
    if total == 0:
        raise SpecError("--hosts", f"no host in {hosts!r}")
    return total


def _command(raw: list[str]) -> tuple[str, ...]:
    cmd = raw[1:] if raw[:1] == ["--"] else raw
    if not cmd:
        raise SpecError("command", "missing: give the program to run, e.g. "
                        "`hora run -np 2 -- python train.py`")
    program = cmd[0]
    if os.sep not in program and shutil.which(program) is None:
        raise SpecError("command", f"{program!r} was not found on PATH")
    if os.sep in program and not os.access(program, os.X_OK):
        raise SpecError("command", f"{program!r} does not exist or is not executable")
    return tuple(cmd)


def _timeline(raw: str | None, cwd: Path) -> Path | None:
    if raw is None:
        return None
    if not raw.strip():
        raise SpecError("--timeline-filename", "must not be empty")
    path = (cwd / raw).resolve()
    if not path.parent.is_dir():
        raise SpecError("--timeline-filename", f"directory {str(path.parent)!r} does not exist")
    if path.is_dir():
        raise SpecError("--timeline-filename", f"{str(path)!r} is a directory")
    return path


def _np(raw_np: str | None, hosts: str | None) -> int:
    slots = parse_hosts(hosts, [socket.gethostname()]) if hosts is not None else None
    if raw_np is None:
        if slots is None:
            raise SpecError("-np", "missing: say how many ranks to start, e.g. -np 2")
        return slots
    np = int(_number("-np", raw_np, int, 1, 4096))
    if slots is not None and np > slots:
        raise SpecError("-np", f"{np} ranks do not fit the {slots} slots of --hosts {hosts}")
    return np


def _elastic(ns: argparse.Namespace, np: int, cwd: Path) -> ElasticConfig | None:
    """The elastic settings, when any elastic flag was given."""
    found = (ns.min_np, ns.max_np, ns.host_discovery_script, ns.host_file)
    if all(v is None for v in found):
        return None
    min_np = int(_number("--min-np", ns.min_np, int, 1, 4096)) if ns.min_np else np
    max_np = int(_number("--max-np", ns.max_np, int, 1, 4096)) if ns.max_np else None
    if max_np is None:
        max_np = 4096 if ns.host_discovery_script or ns.host_file else max(np, min_np)
    if not min_np <= np <= max_np:
        raise SpecError("-np", f"{np} must be between --min-np {min_np} and --max-np {max_np}")
    script = None
    if ns.host_discovery_script is not None:
        path = (cwd / ns.host_discovery_script).resolve()
        if not os.access(path, os.X_OK) or path.is_dir():
            raise SpecError("--host-discovery-script", f"{str(path)!r} is not an executable file")
        script = (str(path),)
    host_file = None
    if ns.host_file is not None:
        if script is not None:
            raise SpecError("--host-file", "give --host-file or --host-discovery-script, not both")
        # not resolved: /proc/self/fd/N/NAME (a descriptor of a directory the job's account
        # cannot reach by its path, the service's elastic jobs) must stay that
        host_file = Path(os.path.abspath(cwd / ns.host_file))
        if not host_file.is_file():
            raise SpecError("--host-file", f"{str(host_file)!r} is not a file")
    low, high = (_number("--blacklist-cooldown-range", v, float, 0.0, 1e6)
                 for v in ns.blacklist_cooldown_range)  # fmt: skip
    if low > high:
        raise SpecError("--blacklist-cooldown-range", f"LOW {low:g} is above HIGH {high:g}")
    limit = ns.reset_limit
    return ElasticConfig(
        min_np=min_np, max_np=max_np, discovery=script,
        slots=parse_hosts(ns.hosts, [socket.gethostname()]) if ns.hosts else np,
        reset_limit=int(_number("--reset-limit", limit, int, 0, 1e9)) if limit else None,
        timeout=_number("--elastic-timeout", ns.elastic_timeout, float, 0.1, 1e7),
        cooldown=(low, high), host_file=host_file, report=ns.report_membership,
    )


def parse_args(argv: Sequence[str], cwd: Path | None = None) -> LaunchConfig:
    """Parse the arguments after ``run`` into a validated :class:`LaunchConfig`.

    Args:
        argv: arguments after the subcommand, e.g. ``["-np", "2", "--", "python", "x.py"]``.
        cwd: directory relative paths are resolved against (default: the current one).

    Returns:
        The frozen launch description.

    Raises:
        SpecError: naming the flag (``-np``, ``--start-timeout``, ``command``...) that is wrong.

    Example:
        >>> parse_args(["-np", "2", "--", "python", "-c", "pass"]).np
        2
    """
    ns = make_parser().parse_args(list(argv))
    backend = ns.backend.lower() if ns.backend is not None else None
    if backend is not None and backend not in BACKENDS:
        raise SpecError("--backend", f"must be one of {', '.join(BACKENDS)}, got {ns.backend!r}")
    port = ns.master_port
    timeout = ns.start_timeout
    np = _np(ns.np, ns.hosts)
    return LaunchConfig(
        np=np,
        command=_command(list(ns.command)),
        timeline_filename=_timeline(ns.timeline_filename, cwd or Path.cwd()),
        start_timeout=_number("--start-timeout", timeout, float, 0.001, 1e7) if timeout else None,
        master_port=int(_number("--master-port", port, int, 1, 65535)) if port else None,
        backend=backend,
        grace_period=_number("--grace-period", ns.grace_period, float, 0.0, 3600.0),
        elastic=_elastic(ns, np, cwd or Path.cwd()),
    )


def launch_extra(config: LaunchConfig) -> dict[str, str]:
    """Return the hora settings every rank gets on top of its world variables.

    Args:
        config: the launch description.

    Returns:
        ``HOROVOD_TIMELINE``, ``HORA_START_TIMEOUT``/``HORA_TIMEOUT`` and ``HORA_BACKEND``,
        each only when the matching flag was given.

    Example:
        >>> launch_extra(LaunchConfig(np=1, command=("true",), backend="gloo"))
        {'HORA_BACKEND': 'gloo'}
    """
    extra: dict[str, str] = {}
    if config.timeline_filename is not None:
        extra["HOROVOD_TIMELINE"] = str(config.timeline_filename)
    timeouts = config.start_timeout
    extra.update(
        RankEnv(start_timeout=timeouts, timeout=timeouts, backend=config.backend).to_environ()
    )
    return extra


def build_rank_envs(
    config: LaunchConfig,
    base_env: Mapping[str, str],
    master_port: int,
    rdzv_secret: str | None = None,
) -> list[dict[str, str]]:
    """Return the full environment of every rank, in rank order.

    Each is ``base_env`` without a parent launcher's world variables, plus
    :func:`hora.env.rank_env` for that rank, plus :func:`launch_extra` (layered by
    :func:`hora.env.layered_env`). Python output is made unbuffered (so lines stream live
    through the rank prefixer) and ``OMP_NUM_THREADS`` set to 1, as torchrun does, unless the
    base environment already sets them (:data:`hora.env.TORCHRUN_DEFAULTS`).

    Args:
        config: the launch description.
        base_env: the environment to start from (the launcher's ``os.environ``).
        master_port: the rendezvous port every rank connects to.
        rdzv_secret: the ranks' rendezvous secret (``HORA_RDZV_SECRET``); None: a fresh one,
            so a launch inside a job never shares the job's own.

    Returns:
        ``config.np`` new dicts; ``base_env`` is not modified.

    Example:
        >>> envs = build_rank_envs(LaunchConfig(np=2, command=("true",)), {}, 29500)
        >>> [e["RANK"] for e in envs]
        ['0', '1']
    """
    secret = RankEnv(rdzv_secret=rdzv_secret or new_rdzv_secret())
    extra = {**launch_extra(config), **secret.to_environ()}
    worlds = (
        rank_env(r, config.np, master_addr=config.master_addr, master_port=master_port, extra=extra)
        for r in range(config.np)
    )
    return [
        layered_env(base_env, strip=LAUNCHER_VARS, rank={**TORCHRUN_DEFAULTS, **world},
                    defaults=TORCHRUN_DEFAULTS)
        for world in worlds
    ]  # fmt: skip
