"""Runtimes of the job service: where a job's ranks run (control plane).

Chosen by name from :data:`REGISTRY`, whose factories import their module only when used.
``local`` runs one process per rank on this machine; ``docker`` and ``slurm`` arrive with
their own issues and are refused at submission until then.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from hora.errors import SpecError

from hora_service.runtimes.base import AttemptPlan, Exit, RankProcess, Runtime

__all__ = ["REGISTRY", "AttemptPlan", "Exit", "RankProcess", "Runtime", "available", "create"]

# name -> "module:factory"
REGISTRY: dict[str, str] = {"local": "hora_service.runtimes.local:LocalRuntime"}


def available() -> list[str]:
    """Names of the runtimes this service can run."""
    return sorted(REGISTRY)


def create(name: str) -> Runtime:
    """Build the runtime called ``name``.

    Raises:
        SpecError: no such runtime here (field ``runtime``).
    """
    target = REGISTRY.get(name)
    if target is None:
        raise SpecError(
            "runtime",
            f"runtime {name!r} is not available here (available: {', '.join(available())})",
        )
    module, _, attr = target.partition(":")
    factory: Callable[[], Runtime] = getattr(importlib.import_module(module), attr)
    return factory()
