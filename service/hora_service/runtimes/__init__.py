"""Runtimes of the job service: where a job's ranks run (control plane).

Chosen by name from :data:`REGISTRY`, whose factories import their module only when used.
``local`` runs one process per rank on this machine, ``docker`` one container per attempt
holding every rank (:mod:`hora_service.runtimes.docker`), ``slurm`` one Slurm batch job per
attempt (:mod:`hora_service.runtimes.slurm`). A factory takes the service's settings.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hora.errors import SpecError

from hora_service.runtimes.base import AttemptPlan, Exit, RankProcess, Runtime

if TYPE_CHECKING:
    from hora_service.settings import Settings

__all__ = ["REGISTRY", "AttemptPlan", "Exit", "RankProcess", "Runtime", "available", "create"]

# name -> "module:factory"
REGISTRY: dict[str, str] = {
    "local": "hora_service.runtimes.local:LocalRuntime.from_settings",
    "docker": "hora_service.runtimes.docker:DockerRuntime.from_settings",
    "slurm": "hora_service.runtimes.slurm:SlurmRuntime.from_settings",
}


def available() -> list[str]:
    """Names of the runtimes this service can run."""
    return sorted(REGISTRY)


def create(name: str, settings: Settings) -> Runtime:
    """Build the runtime called ``name`` with the service's settings.

    Raises:
        SpecError: no such runtime here (field ``runtime``).
    """
    target = REGISTRY.get(name)
    if target is None:
        raise SpecError(
            "runtime",
            f"runtime {name!r} is not available here (available: {', '.join(available())})",
        )
    module, _, path = target.partition(":")
    factory: Any = importlib.import_module(module)
    for attr in path.split("."):
        factory = getattr(factory, attr)
    made: Runtime = factory(settings)
    return made
