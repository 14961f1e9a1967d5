"""Checks, as the job's own account, that a job can start: its working directory and program.

Control plane. The service runs as root in multi-user mode, so its own view of a path (and
``os.access``, which asks with its real uid) says nothing of what a job's account may do.
:func:`check` runs a short-lived child (:mod:`~hora_service.runtimes.startcheck_child`, this
interpreter with ``-I -S``, standard library only) that clears its supplementary groups and
sets its gid and uid to the account's exactly as the rank shim does, then checks that it can
enter the working directory and resolves the program on the job's ``PATH`` as ``execvp``
would. Where the job runs as the service's own account (single-user and shared modes) the same
check runs in the service's process, without a child. What it cannot do comes back as a
:class:`~hora.errors.SpecError` naming the field (``working_dir`` or ``command``) and the
path, so that a submission is a 422 and a launch fails at once with that reason, instead of a
bare "exit code 127" or a ``PermissionError`` deep inside ``torch.save``.

It looks at paths as the job will: with a private ``/tmp`` (:class:`Sight`), what lies
there is hidden unless it stays visible, and it finds which of the directories the job was
given its account reaches (the service keeps those visible: :func:`check` returns them).
Where a job runs in a virtual or conda environment (``VIRTUAL_ENV``, ``CONDA_PREFIX`` in
its env), its account must be able to enter it (field ``env.VIRTUAL_ENV``).

Nothing user-supplied reaches a shell: the paths travel as one JSON argument.

:class:`Passed` remembers the checks that passed for a few seconds (:data:`REUSE_S`), by
everything they looked at: a burst of submissions of one program from one directory (a sweep,
a job array) is checked once, not once a job (in multi-user mode each check is a child
process). Only submission reuses them; a launch always checks afresh.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hora.errors import SpecError

from hora_service.identity import RunAs
from hora_service.runtimes.startcheck_child import ENV_DIRS, inspect

__all__ = ["ENV_DIRS", "REUSE_S", "Passed", "Sight", "check"]

CHECK_TIMEOUT_S = 10.0
REUSE_S = 2.0  # how long a check that passed is taken as still passing (submission only)
CHILD = Path(__file__).with_name("startcheck_child.py")


@dataclass(frozen=True)
class Sight:
    """How much of the host's ``/tmp`` and ``/dev/shm`` a job sees.

    Attributes:
        private_tmp: the job gets its own (:mod:`hora_service.runtimes.namespaces`).
        visible: directories there that stay visible (working directory, work root).
        given: directories there the job was given (``job_tmp_paths``, :func:`~hora_service.
            runtimes.namespaces.given_paths`): those its account reaches stay visible too.
    """

    private_tmp: bool = False
    visible: tuple[str, ...] = ()
    given: tuple[str, ...] = ()


class Passed:
    """Checks that passed within the last ``ttl_s`` seconds, by everything they looked at.

    Args:
        ttl_s: how long a pass holds.
        most: how many are kept (the oldest goes first).
        clock: monotonic seconds.

    Example:
        >>> passed = Passed(ttl_s=2.0, clock=lambda: 10.0)
        >>> passed.put(("ann", "/tmp"), ())
        >>> passed.get(("ann", "/tmp")), passed.get(("bob", "/tmp"))
        ((), None)
    """

    def __init__(
        self, ttl_s: float = REUSE_S, most: int = 256, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.most = most
        self.clock = clock
        self._lock = threading.Lock()
        self._until: dict[Hashable, tuple[float, tuple[Path, ...]]] = {}

    def get(self, key: Hashable) -> tuple[Path, ...] | None:
        """What the check of ``key`` returned, if it passed within ``ttl_s``; else None."""
        with self._lock:
            hit = self._until.get(key)
        return hit[1] if hit is not None and self.clock() < hit[0] else None

    def put(self, key: Hashable, kept: tuple[Path, ...]) -> None:
        """Record that the check of ``key`` passed now, returning ``kept``."""
        with self._lock:
            self._until.pop(key, None)
            while len(self._until) >= self.most:
                del self._until[next(iter(self._until))]
            self._until[key] = (self.clock() + self.ttl_s, kept)


def check(
    who: RunAs | None,
    workdir: Path,
    program: str | None,
    path_env: str,
    writable: bool = False,
    env: Mapping[str, str] | None = None,
    sight: Sight | None = None,
    timeout_s: float = CHECK_TIMEOUT_S,
    passed: Passed | None = None,
) -> tuple[Path, ...]:
    """Check as ``who`` that ``workdir`` can be entered and ``program`` executed.

    Args:
        who: the job's account (None: the service's own, in single-user and shared modes).
        workdir: the job's working directory (absolute).
        program: ``command[0]``, resolved on ``path_env`` unless it has a ``/`` (relative to
            ``workdir`` then); None: check the directory only (a docker job's program is in
            its image).
        path_env: the job's ``PATH``.
        writable: the directory must be writable too (the user's default working directory).
        env: the job's ``VIRTUAL_ENV`` and ``CONDA_PREFIX`` to check (None: none).
        sight: how much of ``/tmp`` the job sees (None: all of it).
        timeout_s: how long the check may take.
        passed: checks that passed lately: one with the same arguments is not made again,
            and a pass is recorded there (None: always check).

    Returns:
        The directories of ``sight.given`` the account reaches (to keep visible).

    Raises:
        SpecError: field ``working_dir``, ``command`` or ``env.VIRTUAL_ENV`` (``env.CONDA_
            PREFIX``), the message naming the path.

    Example:
        >>> check(None, Path("/tmp"), "sh", "/usr/bin:/bin")
        ()
    """
    name = f"account {who.user} (uid {who.uid})" if who is not None else "the job's account"
    sight = sight or Sight()
    dirs = tuple(sorted((env or {}).items()))
    key = (who, str(workdir), program, path_env, writable, dirs, sight)
    if passed is not None and (kept := passed.get(key)) is not None:
        return kept
    args: dict[str, object] = {
        "who": name, "workdir": str(workdir), "writable": writable, "program": program,
        "path": path_env, "env": dict(env or {}), "private_tmp": sight.private_tmp,
        "visible": list(sight.visible), "given": list(sight.given),
    }  # fmt: skip
    found = inspect(args) if who is None else _as_account(who, args, timeout_s)
    if "field" in found:
        raise SpecError(str(found["field"]), str(found["message"]))
    keep = found.get("keep")
    kept = tuple(Path(str(p)) for p in keep) if isinstance(keep, list) else ()
    if passed is not None:
        passed.put(key, kept)
    return kept


def _as_account(who: RunAs, args: dict[str, object], timeout_s: float) -> dict[str, object]:
    """:func:`~hora_service.runtimes.startcheck_child.inspect` in a child dropped to ``who``."""
    args = {**args, "uid": who.uid, "gid": who.gid}
    what = f"cannot check {args['workdir']} as {args['who']}"
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", str(CHILD), json.dumps(args)],
            capture_output=True, text=True, timeout=timeout_s, env={}, cwd="/",
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SpecError("working_dir", f"{what}: {e}") from None
    try:
        found: object = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        found = None
    if not isinstance(found, dict):
        why = done.stderr.strip().splitlines()[-1:] or [f"status {done.returncode}"]
        raise SpecError("working_dir", f"{what}: {why[0]}")
    return found
