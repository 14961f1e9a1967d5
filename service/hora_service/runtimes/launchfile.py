"""What a rank's shim is told to run: the launch file, one typed value (control plane).

The local and Slurm runtimes write one ``rank<R>.launch`` per rank (read by
:mod:`hora_service.runtimes.shim`, which never takes the command from its argv): the command,
its environment and working directory, the account it runs as, its cgroups, namespaces, log
limit and whether the shim gives it a temporary directory of its own. Built by
:meth:`LaunchFile.of_plan`, a pure function of the plan; extended by ``with_*`` copies, never
mutated; written by :func:`private_file` (created as the service's, no link followed).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hora_service.runtimes.base import AttemptPlan

__all__ = ["LaunchFile", "private_file"]


@dataclass(frozen=True)
class LaunchFile:
    """One rank's launch file.

    Example:
        >>> f = LaunchFile(command=("python", "t.py"), env={"A": "1"}, cwd="/w")
        >>> f.with_env(B="2").env == {"A": "1", "B": "2"} and f.env == {"A": "1"}
        True
        >>> sorted(json.loads(f.with_namespaces([5]).to_json()))[:4]
        ['cgroups', 'command', 'cwd', 'env']
    """

    command: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str  # entered by the command once it runs as the job's account
    uid: int | None = None
    gid: int | None = None
    cgroups: tuple[str, ...] = ()
    log_limit: int | None = None
    umask: int = 0o077
    run_dir_arg: int | None = None  # an elastic driver's slot file, read through the run dir
    namespaces: tuple[int, ...] = field(default=())  # descriptors the shim setns() into
    own_tmp: bool = False  # the shim makes the command a TMPDIR of its own, removed at its end

    @classmethod
    def of_plan(cls, plan: AttemptPlan, env: Mapping[str, str]) -> LaunchFile:
        """The launch file of one rank of ``plan`` whose environment is ``env``."""
        who = plan.run_as
        return cls(
            command=tuple(plan.command), env=dict(env), cwd=str(plan.workdir),
            uid=who.uid if who is not None else None, gid=who.gid if who is not None else None,
            cgroups=tuple(str(d) for d in plan.container.dirs) if plan.container else (),
            log_limit=plan.rank_log_bytes, umask=plan.umask,
        )  # fmt: skip

    def with_env(self, **extra: str) -> LaunchFile:
        """A copy whose environment also holds ``extra``."""
        return dataclasses.replace(self, env={**self.env, **extra})

    def with_namespaces(self, fds: Sequence[int]) -> LaunchFile:
        """A copy that enters the namespaces of the descriptors ``fds``."""
        return dataclasses.replace(self, namespaces=tuple(fds))

    def to_json(self) -> str:
        """The file's text, as the shim reads it."""
        data = dataclasses.asdict(self)
        data.update(command=list(self.command), env=dict(self.env), cgroups=list(self.cgroups))
        data["namespaces"] = list(self.namespaces)
        if self.run_dir_arg is None:
            del data["run_dir_arg"]
        if not self.own_tmp:
            del data["own_tmp"]
        return json.dumps(data)


def private_file(path: Path, gid: int, mode: int, text: str = "") -> None:
    """Create ``path`` as the service's, with group ``gid`` and ``mode`` (from the start).

    A link planted at ``path`` is never followed (``O_NOFOLLOW``).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        if os.geteuid() == 0 or gid == os.getegid():
            os.fchown(fd, -1, gid)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
