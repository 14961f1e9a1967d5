"""The words that decide where and what runs: runtime, slot kind, job kind (data plane).

Enums, not strings, wherever code branches on them. They live here, with the standard
library only, so that the notebook's magics can use them without importing pydantic at
``%load_ext`` time; :mod:`hora.spec` uses them in its models and re-exports them.

Example:
    >>> RuntimeName("docker") is RuntimeName.docker, SlotKind.gpu == "gpu"
    (True, True)
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["HolderKind", "JobKind", "RuntimeName", "SlotKind"]


class RuntimeName(StrEnum):
    """Where a job's processes run."""

    local = "local"
    docker = "docker"
    slurm = "slurm"


class SlotKind(StrEnum):
    """What a schedulable slot is (``SlotInfo.kind``); ``parked`` lists a parked session."""

    gpu = "gpu"
    cpu = "cpu"
    parked = "parked"


class JobKind(StrEnum):
    """What the scheduler runs: a submitted job, or a notebook's session of engines."""

    job = "job"
    session = "session"


class HolderKind(StrEnum):
    """Who claims a slot's machine-wide lease (:mod:`hora.leases`): a service or a kernel."""

    service = "service"
    kernel = "kernel"
