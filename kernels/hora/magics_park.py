"""What ``%dist_park`` and ``%dist_resume`` do in the notebook (data plane).

The magics (:mod:`hora.magics`) parse; this module calls the session cluster and shows what
happened: the park's line, the resume's line (when and why the session was parked, how long
each step took, what did not come back), the table of a user's parked sessions, and a new
kernel adopting one of them (its options read back from the session's job).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from hora.magics_display import QueueDisplay, Table, notify

if TYPE_CHECKING:
    from hora.engines import Cluster
    from hora.engines.session import ServiceCluster
    from hora.spec import SessionInfo


def session_cluster(cluster: Cluster | None, what: str) -> ServiceCluster:
    """The running session cluster, or a usage error saying why there is none."""
    from hora.engines.session import ServiceCluster
    from hora.engines.state import ClusterState

    if not isinstance(cluster, ServiceCluster):
        where = "no engines run" if cluster is None else "these engines are kernel-local"
        raise UsageError(
            f"{what}: {where}; only a session of the hora service parks (its slots go back to "
            "the service's pool)"
        )
    if cluster.state is ClusterState.PARKED:
        raise UsageError(f"{what}: session {cluster.launcher.resuming} is parked already")
    return cluster


def park(cluster: ServiceCluster, drop: list[str], force: bool) -> None:
    """Park the session; print what was saved (and left out)."""
    report = cluster.park(drop, force)
    sys.stdout.write(report.line() + "\n")


def resume(cluster: ServiceCluster, n: int | None = None) -> None:
    """Resume the parked session (queued like a start); print why it was parked and the times."""
    queue = QueueDisplay()
    cluster.launcher.progress = queue.update
    report = cluster.resume(n)
    queue.done(cluster)
    sys.stdout.write(f"{report.why()}\n{report.line()}\n")


def parked_sessions(cluster: Cluster | None = None) -> list[SessionInfo]:
    """The user's parked sessions, newest first (asked with a session's own client, if any)."""
    from hora.client import Client
    from hora.engines.session import ServiceCluster
    from hora.session_wire import SessionList

    service = cluster.launcher.service if isinstance(cluster, ServiceCluster) else Client()
    found = service.request("GET", "/v1/sessions", params={"state": "parked", "limit": 500})
    return SessionList.model_validate(found.json()).items


def show_parked(cluster: Cluster | None = None) -> None:
    """Display the user's parked sessions (``%dist_resume`` without an id)."""
    from IPython.display import display

    from hora.engines.parking import parked_table

    rows = parked_table(parked_sessions(cluster))
    if not rows:
        sys.stdout.write("no parked sessions; %dist_park parks this notebook's\n")
        return
    display(Table(rows, "your parked sessions: %dist_resume ID takes one"))


def adopt(session_id: int) -> ServiceCluster:
    """A cluster that resumes parked session ``session_id`` (started by another kernel).

    Its options (engines, backend, timeouts, runtime) are the session's own.

    Raises:
        UsageError: no such session of this user, or not a session.
    """
    from hora.client import Client, ServiceError
    from hora.engines import ClusterOptions
    from hora.engines.session import ServiceCluster
    from hora.env import RankEnv
    from hora.spec import JobInfo, JobKind

    service = Client()
    try:
        job = JobInfo.model_validate(service.request("GET", f"/v1/jobs/{session_id}").json())
    except ServiceError as e:
        raise UsageError(f"%dist_resume {session_id}: {e}") from None
    if job.kind != JobKind.session:
        raise UsageError(f"%dist_resume {session_id}: job {session_id} is not a session")
    env = RankEnv.from_environ(job.spec.env, only=("backend", "timeout", "start_timeout"))
    options = ClusterOptions(
        n=job.spec.workers,
        backend=env.backend,
        timeout_s=env.timeout or 60.0,
        start_timeout_s=env.start_timeout or 60.0,
    )
    return ServiceCluster(
        options, service, notify=notify, runtime=job.spec.runtime.value, resume=session_id,
        image=job.spec.image,
    )
