"""Runtimes of the job service: where a job's ranks run (control plane).

Chosen by the spec's :class:`~hora.spec.RuntimeName` from :data:`REGISTRY`, whose factories
import their module only when used.
``local`` runs one process per rank on this machine, ``docker`` one container per attempt
holding every rank (:mod:`hora_service.runtimes.docker`), ``slurm`` one Slurm batch job per
attempt (:mod:`hora_service.runtimes.slurm`). A factory takes the service's settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hora.errors import SpecError
from hora.spec import RuntimeName

from hora_service.runtimes.base import AttemptPlan, Exit, RankProcess, Runtime

if TYPE_CHECKING:
    from hora_service.settings import Settings

__all__ = ["REGISTRY", "AttemptPlan", "Exit", "RankProcess", "Runtime", "available", "create"]


def _local(settings: Settings) -> Runtime:
    from hora_service.runtimes.local import LocalRuntime

    return LocalRuntime.from_settings(settings)


def _docker(settings: Settings) -> Runtime:
    from hora_service.runtimes.docker import DockerRuntime  # the docker SDK: only when used

    return DockerRuntime.from_settings(settings)


def _slurm(settings: Settings) -> Runtime:
    from hora_service.runtimes.slurm import SlurmRuntime

    return SlurmRuntime.from_settings(settings)


# one factory per runtime, keyed by the spec's enum; each imports its module when first used
REGISTRY: dict[RuntimeName, Callable[[Settings], Runtime]] = {
    RuntimeName.local: _local,
    RuntimeName.docker: _docker,
    RuntimeName.slurm: _slurm,
}


def available() -> list[str]:
    """Names of the runtimes this service can run."""
    return sorted(r.value for r in REGISTRY)


def create(name: RuntimeName | str, settings: Settings) -> Runtime:
    """Build the runtime called ``name`` with the service's settings.

    Raises:
        SpecError: no such runtime here (field ``runtime``).
    """
    try:
        factory = REGISTRY[RuntimeName(name)]
    except (ValueError, KeyError):
        raise SpecError(
            "runtime",
            f"runtime {name!r} is not available here (available: {', '.join(available())})",
        ) from None
    return factory(settings)
