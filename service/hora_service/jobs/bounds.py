"""Where a job runs and within what: its working directory, checks before it starts, limits.

Control plane; the job manager asks it at submission and at each launch.

* :meth:`Bounds.workdir`: ``working_dir`` under the work root; without one, the directory
  the job was submitted from (``submit_dir``) when it lies under the work root, as ``sbatch``
  runs a job where it was submitted; else the user's own working directory in multi-user mode
  (``WORK_ROOT/<user>``, see :mod:`hora_service.users.homes`), or the work root.
  :meth:`Bounds.submit_note` says so when a ``submit_dir`` outside the work root was passed
  over.
* :meth:`Bounds.start_check`: the job's account can enter the working directory and execute
  the program (:mod:`hora_service.runtimes.startcheck`): a 422 naming the field at submission,
  and a job failed at once with the same reason at launch (the directory may have changed).
  At submission (``reuse``) a check that passed with the same arguments in the last
  :data:`~hora_service.runtimes.startcheck.REUSE_S` seconds is not made again.
* :meth:`Bounds.limits`: the attempt's memory, pids and CPU limits (the user's own, else the
  service's settings; see :mod:`hora_service.runtimes.limits`), and :meth:`Bounds.explain`,
  which says in a failed job's reason which limit it hit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from hora.errors import SpecError
from hora.spec import JobKind, JobSpec, RuntimeName

from hora_service.identity import RunAs
from hora_service.runtimes import namespaces, startcheck
from hora_service.runtimes.base import AttemptPlan, Runtime
from hora_service.runtimes.limits import JobLimits, LimitError, Machine, note, resolve
from hora_service.settings import Settings
from hora_service.users.registry import Users

log = logging.getLogger(__name__)


class Bounds:
    """Working directories, start checks and limits of jobs (see the module docstring).

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
        self.passed = startcheck.Passed()

    def workdir(self, spec: JobSpec, user: str | None = None) -> Path:
        """The ranks' working directory.

        ``working_dir`` under the work root; without one, ``submit_dir`` when it lies under
        the work root; else the user's own working directory in multi-user mode (created if
        missing), else the work root.

        Raises:
            SpecError: ``working_dir`` (or the ``submit_dir`` taken) escapes the work root or
                is not an existing directory (field ``working_dir`` or ``submit_dir``).
        """
        root = self.settings.work_root
        if spec.working_dir is not None:
            return self._under_root("working_dir", spec.working_dir)
        if self._submitted_here(spec):
            return self._under_root("submit_dir", str(spec.submit_dir))
        own = self.users.workdir(user) if user is not None else None
        return own if own is not None else root

    def uses_default(self, spec: JobSpec) -> bool:
        """Whether the job runs in the default working directory (neither given nor taken)."""
        return spec.working_dir is None and not self._submitted_here(spec)

    def submit_note(self, spec: JobSpec) -> str | None:
        """Why a job does not run where it was submitted from (None: it does, or none given).

        Example: ``submitted from /data/x, outside the work root /home/ann (setting
        work_root, HORA_WORK_ROOT): it runs in the default working directory; name one
        under the work root with working_dir (hora submit --workdir)``.
        """
        if spec.working_dir is not None or spec.submit_dir is None:
            return None
        if self._submitted_here(spec):
            return None
        return (
            f"submitted from {spec.submit_dir}, outside the work root {self.settings.work_root} "
            "(setting work_root, HORA_WORK_ROOT): it runs in the default working directory; "
            "name one under the work root with working_dir (hora submit --workdir)"
        )

    def _submitted_here(self, spec: JobSpec) -> bool:
        """Whether ``submit_dir`` lies under the work root (by its path as written)."""
        if spec.submit_dir is None:
            return False
        return Path(os.path.normpath(spec.submit_dir)).is_relative_to(self.settings.work_root)

    def _under_root(self, field: str, given: str) -> Path:
        """``given`` (relative to the work root, or absolute) resolved, if a directory under it.

        Raises:
            SpecError: ``field``: it escapes the work root or is not an existing directory.
        """
        root = self.settings.work_root
        try:
            path = (root / given).resolve()
            is_dir = path.is_dir()
        except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a name too long
            why = getattr(e, "strerror", None) or str(e)
            raise SpecError(field, f"{given!r} cannot be used: {why}") from None
        if not path.is_relative_to(root):
            raise SpecError(field, f"{given!r} is outside the work root {root}")
        if not is_dir:
            raise SpecError(field, f"{given!r} is not an existing directory")
        return path

    def start_check(
        self,
        spec: JobSpec,
        workdir: Path,
        who: RunAs | None,
        driver: str | None = None,
        kind: JobKind = JobKind.job,
        reuse: bool = False,
    ) -> tuple[Path, ...]:
        """Check as the job's account that it can enter ``workdir`` and run the program.

        The program, and the ``VIRTUAL_ENV`` / ``CONDA_PREFIX`` of its env, are checked for
        the local runtime only (in docker they are the image's), as the job will see them:
        with its private ``/tmp`` where it gets one. ``driver``: an elastic job's driver
        Python, which the account must run too. ``reuse`` (at submission): a check that
        passed with the same arguments within :data:`~hora_service.runtimes.startcheck.
        REUSE_S` seconds stands; a launch checks afresh.

        Returns:
            The directories under ``/tmp`` the job was given that its account reaches: they
            stay visible in its private ``/tmp``.

        Raises:
            SpecError: field ``working_dir``, ``command``, ``env.VIRTUAL_ENV``,
                ``env.CONDA_PREFIX`` or ``elastic``, naming the path.
        """
        local = spec.runtime == RuntimeName.local
        env = {**self.base_env, **spec.env}
        path = env.get("PATH") or "/usr/bin:/bin"
        program = spec.command[0] if local else None
        # as namespaces.wanted() decides it: a job (not a session) run as its account
        private = local and who is not None and self.settings.job_private_network
        private = private and kind == JobKind.job
        # job_tmp_paths too only where the account reaches them: a bind mount never widens
        # what it can reach (a checkout in a mktemp -d directory stays out of its jobs)
        given = (*map(str, self.settings.job_tmp_paths), *namespaces.given_paths(env, program))
        sight = startcheck.Sight(
            private_tmp=private,
            visible=(str(workdir), str(self.settings.work_root)),
            given=given if private else (),
        )
        passed = self.passed if reuse else None
        kept = startcheck.check(
            who, workdir, program, path,
            writable=self.uses_default(spec) and who is not None,
            env={k: env[k] for k in startcheck.ENV_DIRS if k in env} if local else None,
            sight=sight, passed=passed,
        )  # fmt: skip
        if driver is not None and who is not None:
            try:
                startcheck.check(who, workdir, driver, path, passed=passed)
            except SpecError as e:
                raise SpecError(
                    "elastic", f"the elastic driver's Python (setting session_python): {e.message}"
                ) from None
        return kept

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
