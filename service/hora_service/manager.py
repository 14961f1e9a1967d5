"""The job manager: the service's one owner of job state (control plane).

It validates submissions against this machine (slots, quota, runtime, working directory),
keeps the queue, and runs **one monitor loop** that moves every job through its lifecycle
(``queued -> starting -> running -> succeeded | failed | cancelled``, ``retrying`` between
attempts): it polls ranks, enforces ``timeout_s``, escalates SIGTERM to SIGKILL after the
grace period, retries failed attempts with exponential backoff, and runs the scheduling pass
(:func:`hora_service.scheduler.schedule`) whenever something changed. Submissions and
cancellations wake the loop at once. :meth:`JobManager.tick` is one pass, public so that
tests can drive the loop step by step.

Durability: every transition is written to SQLite before and after processes start, and
each rank's shim leaves pid and exit files in its run directory. :meth:`JobManager.start`
re-adopts ranks still alive from an earlier run of the service, records how finished ones
ended, and fails (then retries per policy) attempts whose ranks vanished without a trace.
A slot is held until every process of the attempt holding it is gone: when an attempt
ends (success, failure, cancel, timeout), the runtime kills whatever is left in its process
container (:meth:`Runtime.clear`), and the slots are freed only once it reports the container
empty. Jobs run as their user's OS account in multi-user mode (:mod:`hora_service.identity`),
with an environment built from an allow-list (:func:`~hora_service.runtimes.core.allowed_env`).

The code is cut by role into :mod:`hora_service.jobs` (admission, reads, slots, the monitor
loop, elastic slots, launching, recovery, and the core with the journaled writes), each a
mixin that :class:`JobManager` inherits; this module puts them together and is where the
rest of the service imports the manager and its types from.
"""

from __future__ import annotations

from hora_service.jobs.attempt import Attempt, Holder, QueueView, describe
from hora_service.jobs.core import (
    CACHE_MAX,
    LATENCY_WINDOW,
    PAGES_MAX,
    RETRY_WRITE_S,
    STOP_JOIN_S,
    ManagerCore,
)
from hora_service.jobs.monitor import Monitor
from hora_service.jobs.reads import Reads
from hora_service.jobs.slots import SlotViews

__all__ = [
    "CACHE_MAX",
    "LATENCY_WINDOW",
    "PAGES_MAX",
    "RETRY_WRITE_S",
    "STOP_JOIN_S",
    "Attempt",
    "Holder",
    "JobManager",
    "ManagerCore",
    "QueueView",
    "describe",
]


class JobManager(Monitor, Reads, SlotViews):
    """Owns the store, the slots and the monitor loop (see the module docstring).

    Args:
        settings: the service settings.
        runtimes: runtimes by name to use instead of building them from the registry
            (tests pass one whose ranks report scripted states).

    Example:
        >>> mgr = JobManager(Settings(data_dir=tmp_path, gpus="0", cpu_slots=2))  # doctest: +SKIP
        >>> mgr.start(); token = mgr.users.create("ann")  # doctest: +SKIP
        >>> mgr.submit("ann", JobSpec(command=["python", "-c", "pass"]))  # doctest: +SKIP
    """
