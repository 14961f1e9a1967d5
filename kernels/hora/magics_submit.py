"""``%dist_submit``'s job path: the cells a notebook ran, written out and submitted as a job.

The magic (in :mod:`hora.magics`) picks the cells and the session; :func:`submit_history`
renders them into a script with the pushed values beside it, submits it (or hands a session's
slots to it) and can follow it. Light at import: the client loads when a job is submitted.
"""

from __future__ import annotations

import os
import pickle
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from hora.errors import HoraError
from hora.export import DEFAULT_EXPORT

if TYPE_CHECKING:
    from hora.client import Job
    from hora.engines import Cluster
    from hora.engines.script import Record


class JobEndedError(HoraError):
    """A job submitted with ``%dist_submit --wait`` failed or was cancelled."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def handoff_session(cluster: Cluster | None) -> int:
    """The id of the service session ``%dist_submit --handoff`` gives to its job."""
    session = getattr(cluster, "session", None)
    if session is None:
        raise UsageError(
            "%dist_submit --handoff: no session of the hora service is running here "
            "(kernel-local engines hold no slots of the service)"
        )
    return int(session.id)


def let_go(cluster: Cluster | None) -> None:
    """After a handoff the kernel forgets its session instead of deleting it.

    The session's record stays readable (stopped, naming the job that took its slots).
    """
    forget = getattr(cluster.launcher, "forget", None) if cluster is not None else None
    if forget is not None:
        forget()


def submit_history(
    history: Sequence[Record],
    *,
    name: str,
    workers: int,
    gpus: int,
    session: int | None,
    wait: bool,
    stop_engines: Callable[[], None],
    export: str = ",".join(DEFAULT_EXPORT),
) -> Job:
    """Submit the recorded cells as a job; with ``session``, hand that session's slots to it.

    Args:
        history: the cells and pushes the engines ran, in order.
        name: the job's name (also the script's file name).
        workers: ranks of the job.
        gpus: GPUs (or CPU slots) per worker.
        session: the service session whose slots the job takes (``--handoff``), or None.
        wait: follow rank 0's log until the job ends.
        stop_engines: ends the kernel's side of the engines after a handoff.
        export: what the job takes from this kernel (:mod:`hora.export`).

    Returns:
        The submitted :class:`hora.Job`.

    Raises:
        UsageError: a cell cannot run as a script (magics, shell escapes).
        JobEndedError: with ``wait``, the job failed or was cancelled.
    """
    from hora.client import Client, parse_spec
    from hora.engines.script import CellRecord, pushed_blobs, render_script
    from hora.errors import SpecError
    from hora.export import client_python, with_export

    try:
        text, blobs = render_script(history), pushed_blobs(history)
    except SpecError as e:
        raise UsageError(f"%dist_submit: {e}") from None
    script, values = write_job_files(Path.cwd() / "hora-jobs", name, text, blobs)
    n = sum(isinstance(r, CellRecord) for r in history)
    # not closed here: the returned Job keeps using it (job.logs(), job.wait())
    client = Client()
    here = client_python()
    command = [sys.executable, str(script), str(values)]
    if session is None:
        job = client.submit(command, workers=workers, gpus=gpus, name=name, export=export)
    else:
        data = {"command": command, "workers": workers, "gpus_per_worker": gpus, "name": name}
        job = client.handoff(session, parse_spec(with_export(data, export, interpreter=here)))
        stop_engines()  # the service stops the engines; this ends the controller
        sys.stdout.write(f"session {session}'s slots handed to job {job.id}\n")
    sys.stdout.write(
        f"submitted job {job.id} ({name}): {n} cells of this notebook, {script}\n"
        f"follow it: hora logs -f {job.id}  (hora status {job.id}, hora cancel {job.id})\n"
    )
    if wait:
        _wait_for_job(job)
    return job


def write_job_files(folder: Path, name: str, text: str, blobs: list[bytes]) -> tuple[Path, Path]:
    """Write the job's script and the pushed values next to it; return both paths."""
    folder.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", name).strip("-.") or "notebook"
    stem = f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    script, values = folder / f"{stem}.py", folder / f"{stem}.pushed.pkl"
    script.write_text(text)
    with values.open("wb") as f:
        pickle.dump(blobs, f)
    return script, values


def _wait_for_job(job: Job) -> None:
    for text in job.follow(0):
        sys.stdout.write(text)
        sys.stdout.flush()
    info = job.status()
    sys.stdout.write(f"job {job.id}: {info.state.value}\n")
    if info.state.value != "succeeded":
        raise JobEndedError(f"job {job.id} {info.state.value}: {info.reason or 'see hora status'}")
