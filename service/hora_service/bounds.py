"""Where a job runs and within what: its working directory, checks before it starts, limits.

Control plane; the job manager asks it at submission and at each launch.

* :meth:`Bounds.workdir`: ``working_dir`` under the work root, or by default the user's own
  working directory in multi-user mode (``WORK_ROOT/<user>``, see :mod:`hora_service.homes`).
* :meth:`Bounds.preflight`: the job's account can enter the working directory and execute
  the program (:mod:`hora_service.runtimes.preflight`): a 422 naming the field at submission,
  and a job failed at once with the same reason at launch (the directory may have changed).
* :meth:`Bounds.limits`: the attempt's memory, pids and CPU limits (the user's own, else the
  service's settings; see :mod:`hora_service.runtimes.limits`), and :meth:`Bounds.explain`,
  which says in a failed job's reason which limit it hit.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from hora.errors import SpecError
from hora.spec import JobSpec

from hora_service.identity import RunAs
from hora_service.runtimes import preflight
from hora_service.runtimes.base import AttemptPlan, Runtime
from hora_service.runtimes.limits import JobLimits, LimitError, Machine, note, resolve
from hora_service.settings import Settings
from hora_service.users import Users

log = logging.getLogger(__name__)


class Bounds:
    """Working directories, preflight checks and limits of jobs (see the module docstring).

    Args:
        settings: the service's settings.
        users: the service's users (their accounts, limits and working directories).
        base_env: the environment jobs start from (its ``PATH`` finds their program).
        total_slots: slots of this machine (``auto`` limits are shares of them).
    """

    def __init__(
        self, settings: Settings, users: Users, base_env: Mapping[str, str], total_slots: int
    ) -> None:
        self.settings = settings
        self.users = users
        self.base_env = base_env
        self.total_slots = total_slots
        self.machine = Machine.here()

    def workdir(self, spec: JobSpec, user: str | None = None) -> Path:
        """The ranks' working directory.

        ``working_dir`` under the work root; without one, the user's own working directory
        in multi-user mode (created if missing), else the work root.

        Raises:
            SpecError: it escapes the work root or is not an existing directory (field
                ``working_dir``).
        """
        root = self.settings.work_root
        if spec.working_dir is None:
            own = self.users.workdir(user) if user is not None else None
            return own if own is not None else root
        try:
            path = (root / spec.working_dir).resolve()
            is_dir = path.is_dir()
        except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a name too long
            why = getattr(e, "strerror", None) or str(e)
            raise SpecError("working_dir", f"{spec.working_dir!r} cannot be used: {why}") from None
        if not path.is_relative_to(root):
            raise SpecError("working_dir", f"{spec.working_dir!r} is outside the work root {root}")
        if not is_dir:
            raise SpecError("working_dir", f"{spec.working_dir!r} is not an existing directory")
        return path

    def preflight(
        self, spec: JobSpec, workdir: Path, who: RunAs | None, driver: str | None = None
    ) -> None:
        """Check as the job's account that it can enter ``workdir`` and run the program.

        The program is checked for the local runtime only (in docker it is the image's);
        ``driver``: an elastic job's driver Python, which the account must run too.

        Raises:
            SpecError: field ``working_dir``, ``command`` or ``elastic``, naming the path.
        """
        local = spec.runtime.value == "local"
        path = spec.env.get("PATH") or self.base_env.get("PATH") or "/usr/bin:/bin"
        preflight.check(
            who, workdir, spec.command[0] if local and spec.command else None, path,
            writable=spec.working_dir is None and who is not None,
        )  # fmt: skip
        if driver is not None and who is not None:
            try:
                preflight.check(who, workdir, driver, path)
            except SpecError as e:
                raise SpecError(
                    "elastic", f"the elastic driver's Python (setting session_python): {e.message}"
                ) from None

    def limits(self, user: str, slots: int) -> JobLimits:
        """The limits of an attempt of ``user`` holding ``slots`` slots.

        A user's own value that no longer reads (written by another version) falls back on
        the service's setting, with a warning.
        """
        values = dict(self.settings.limit_values)
        found = self.users.limits_of(user)
        values.update(found)
        try:
            return resolve(values, slots, self.total_slots, self.machine)
        except LimitError as e:
            log.warning("user %s: limit %s ignored: %s", user, e.field, e)
            return resolve(self.settings.limit_values, slots, self.total_slots, self.machine)

    def explain(
        self, runtime: Runtime, plan: AttemptPlan, rank: int, why: str, status: object
    ) -> str:
        """``why`` (a rank's failure), saying which of the attempt's limits it hit, if any.

        Example: ``rank 1 was killed by the memory limit (2 GiB per attempt)``.
        """
        if plan.limits is None:
            return why
        try:
            found = runtime.limit_hits(plan)
        except OSError:
            return why
        killed_by, extra = note(plan.limits, found, killed=status == -9)
        if killed_by is not None:
            why = f"rank {rank} {killed_by}"
        return f"{why} ({extra})" if extra else why
