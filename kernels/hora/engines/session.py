"""Engines from the hora service: a cluster whose engines are a scheduled session (data plane).

When a service is configured (``HORA_URL`` / ``HORA_TOKEN`` or ``~/.hora/config``, as ``hora
up`` writes), ``%dist_start`` asks it for engines instead of starting them itself: the kernel
starts only the ipyparallel controller, sends its engine connection info to ``POST
/v1/sessions``, and waits in the service's queue (the position, what holds the slots and an
estimate are shown live; Ctrl-C withdraws the request). The service starts the engines like a
job's ranks (the owner's account, containment, rank environment, GPU binding); they register
with the controller and the cluster works as a kernel-local one.

A background thread heartbeats the session: the service frees the slots of a kernel that stops
(kill -9) once the lease runs out, and with each heartbeat learns how long the engines have
been idle; its warning before the idle timeout is shown in the notebook, and once the service
ended the session the next ``%%distributed`` cell says why and how to get engines back.

:class:`ServiceCluster` is a :class:`~hora.engines.cluster.Cluster` wired with a
:class:`~hora.engines.session_launcher.SessionLauncher` (the queue, the heartbeat, the
replacements) and a :class:`~hora.engines.parking.Parker`, which is given the cluster's
engine group, launcher and lock and its ``start``/``release`` as callables, never the cluster.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence

from hora.client import Client
from hora.client_config import config_path
from hora.engines import plan
from hora.engines.cluster import Cluster, kernel_cuda_initialized
from hora.engines.heartbeat import SessionHeartbeat, render_queue
from hora.engines.parking import Parker, ParkReport, ResumeReport
from hora.engines.session_launcher import SessionLauncher, SessionWithdrawn
from hora.engines.state import ClusterState
from hora.errors import HoraError
from hora.spec import SessionInfo

log = logging.getLogger("hora.engines")
__all__ = [
    "ServiceCluster", "SessionHeartbeat", "SessionLauncher", "SessionWithdrawn",
    "render_queue", "service_configured",
]  # fmt: skip

PARK_ON_EXIT = "HORA_PARK_ON_EXIT"  # "1": a kernel that exits parks its session


def service_configured(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a hora service is configured for this kernel (env or ``~/.hora/config``).

    Example:
        >>> service_configured({"HORA_URL": "http://127.0.0.1:8000"})
        True
    """
    env = os.environ if environ is None else environ
    return bool(env.get("HORA_URL") or env.get("HORA_TOKEN")) or config_path(env).is_file()


class ServiceCluster(Cluster):
    """A :class:`Cluster` whose engines are a session of the hora service (module docstring).

    It wires a :class:`SessionLauncher`, shows its session, and parks and resumes it
    (:class:`hora.engines.parking.Parker`).

    Args:
        options: how many engines, backend, timeouts (``gpus`` is the service's choice).
        service: the service client (default: :class:`hora.Client` from the configuration).
        progress: called with the session while it is queued (the magic shows it live).
        notify: shows heartbeat notices (idle warning, the session's end) in the notebook.
        idle_timeout_s: the idle timeout to ask for (default: the service's).
        cuda_check: as for :class:`Cluster`.
        runtime: where the service starts the engines: ``local`` (its machine) or ``slurm``
            (one Slurm job; the controller then listens on an address the nodes reach).
        ip: that address (default: the one the service names, ``GET /v1/session-address``).
        resume: the id of a parked session to resume (see :meth:`resume`) instead of
            starting a new one.
        image: the engines' image, for the ``docker`` runtime (it must have hora).

    Example:
        >>> c = ServiceCluster(plan.ClusterOptions(n=2))  # doctest: +SKIP
        >>> c.start(); c.session.id  # doctest: +SKIP
        12
        >>> print(c.park().line())  # doctest: +SKIP
        parked session 12 in 1.9 s: 412 MB (3 names a rank); slots freed; ...
        >>> print(c.resume().line())  # doctest: +SKIP
        resumed session 12 in 6.1 s (queued 0.4 s, engines 3.9 s, restore 1.8 s: ...)
    """

    launcher: SessionLauncher

    def __init__(
        self,
        options: plan.ClusterOptions | None = None,
        service: Client | None = None,
        progress: Callable[[SessionInfo], None] | None = None,
        notify: Callable[[str], None] | None = None,
        idle_timeout_s: float | None = None,
        cuda_check: Callable[[], bool] = kernel_cuda_initialized,
        runtime: str = "local",
        ip: str | None = None,
        resume: int | None = None,
        image: str | None = None,
    ) -> None:
        options = options or plan.ClusterOptions()
        launcher = SessionLauncher(
            options, service, progress, notify, idle_timeout_s, runtime, ip,
            ready=lambda: self.state is ClusterState.READY, image=image,
        )  # fmt: skip
        super().__init__(options, cuda_check, launcher)
        self.parker = Parker(
            self.group, launcher, self.lock, start=self.start, release=self.release, notify=notify
        )
        launcher.on_park = self.parker.requested
        if resume is not None:
            launcher.resuming, self.state = resume, ClusterState.PARKED

    def park(self, drop: Sequence[str] = (), force: bool = False) -> ParkReport:
        """Save the engines' namespaces and give the slots back (see :class:`Parker`)."""
        return self.parker.park(drop, force)

    def resume(self, n: int | None = None) -> ResumeReport:
        """Start the parked session's engines again and restore them (see :class:`Parker`)."""
        return self.parker.resume(n)

    def release(self) -> None:
        """The session is parked: let go of the engines and the controller, end nothing."""
        self.group.disconnect()
        self.launcher.release()
        self.group.forget_engines(ClusterState.PARKED)

    def parked_by_service(self) -> bool:
        """The service holds the session parked while this cluster still thinks it runs.

        (A park whose confirmation was lost.) The cluster then lets its engines go.
        """
        beat = self.launcher.heartbeat
        if self.state is ClusterState.READY and beat is not None and beat.parked is not None:
            self.release()
            return True
        return False

    def close(self) -> None:
        """At the kernel's exit: a parked session stays parked; a running one is ended.

        With ``HORA_PARK_ON_EXIT=1`` in the kernel's environment (JupyterHub's culler sets
        it) a running session is parked instead (as ``--force``: whatever cannot be saved
        is left out, and named when it resumes).
        """
        if self.state is ClusterState.READY and os.environ.get(PARK_ON_EXIT) == "1":
            try:
                self.parker.park(force=True, cause="exit")
            except HoraError as e:
                log.warning("could not park session at exit: %s", e)
        if self.state is ClusterState.PARKED:
            self.launcher.forget()
            self.state = ClusterState.STOPPED
            return
        self.stop()

    @property
    def session(self) -> SessionInfo | None:
        """The session, as the service last answered it (None when stopped)."""
        return self.launcher.session

    @property
    def asked(self) -> int | None:
        """The id of the last session asked for (kept after stop)."""
        return self.launcher.asked

    @property
    def heartbeat(self) -> SessionHeartbeat | None:
        """The session's heartbeat thread (None when stopped)."""
        return self.launcher.heartbeat

    @property
    def queued_s(self) -> float:
        """How long the last start waited in the queue."""
        return self.launcher.queued_s

    @property
    def where(self) -> str:
        """Where the engines come from, for the magics' output."""
        return self.launcher.where
