"""Checks, as the job's own account, that a job can start: its working directory and program.

Control plane. The service runs as root in multi-user mode, so its own view of a path (and
``os.access``, which asks with its real uid) says nothing of what a job's account may do.
:func:`check` runs a short-lived child (:mod:`~hora_service.runtimes.preflight_child`, this
interpreter with ``-I -S``, standard library only) that clears its supplementary groups and
sets its gid and uid to the account's exactly as the rank shim does, then checks that it can
enter the working directory and resolves the program on the job's ``PATH`` as ``execvp``
would. Where the job runs as the service's own account (single-user and shared modes) the same
check runs in the service's process, without a child. What it cannot do comes back as a
:class:`~hora.errors.SpecError` naming the field (``working_dir`` or ``command``) and the
path, so that a submission is a 422 and a launch fails at once with that reason, instead of a
bare "exit code 127" or a ``PermissionError`` deep inside ``torch.save``.

Nothing user-supplied reaches a shell: the paths travel as one JSON argument.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hora.errors import SpecError

from hora_service.identity import RunAs
from hora_service.runtimes.preflight_child import inspect

CHECK_TIMEOUT_S = 10.0
CHILD = Path(__file__).with_name("preflight_child.py")


def check(
    who: RunAs | None,
    workdir: Path,
    program: str | None,
    path_env: str,
    writable: bool = False,
    timeout_s: float = CHECK_TIMEOUT_S,
) -> None:
    """Check as ``who`` that ``workdir`` can be entered and ``program`` executed.

    Args:
        who: the job's account (None: the service's own, in single-user and shared modes).
        workdir: the job's working directory (absolute).
        program: ``command[0]``, resolved on ``path_env`` unless it has a ``/`` (relative to
            ``workdir`` then); None: check the directory only (a docker job's program is in
            its image).
        path_env: the job's ``PATH``.
        writable: the directory must be writable too (the user's default working directory).
        timeout_s: how long the check may take.

    Raises:
        SpecError: field ``working_dir`` or ``command``, the message naming the path.

    Example:
        >>> check(None, Path("/tmp"), "sh", "/usr/bin:/bin")  # doctest: +SKIP
    """
    name = f"account {who.user} (uid {who.uid})" if who is not None else "the job's account"
    args: dict[str, object] = {
        "who": name,
        "workdir": str(workdir),
        "writable": writable,
        "program": program,
        "path": path_env,
    }
    found = inspect(args) if who is None else _as_account(who, args, timeout_s)
    if found:
        raise SpecError(str(found["field"]), str(found["message"]))


def _as_account(who: RunAs, args: dict[str, object], timeout_s: float) -> dict[str, str]:
    """:func:`~hora_service.runtimes.preflight_child.inspect` in a child dropped to ``who``."""
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
        found: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        why = done.stderr.strip().splitlines()[-1:] or [f"status {done.returncode}"]
        raise SpecError("working_dir", f"{what}: {why[0]}") from None
    return found
