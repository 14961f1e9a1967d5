"""Python client of the hora job service (data plane; talks to the control plane over HTTP).

``hora.Client(url, token).submit([...], workers=2)`` returns a :class:`Job` with ``.status()``,
``.logs()``, ``.wait()`` and ``.cancel()``. The job description is parsed into a
:class:`hora.spec.JobSpec` here, so bad input fails before any request is sent; the service
validates it again. This module imports only httpx and pydantic (never fastapi or
``hora_service``), so ``import hora`` stays light.

URL and token come from the arguments, else ``HORA_URL`` / ``HORA_TOKEN``, else the JSON file
``~/.hora/config`` (``{"url": ..., "token": ...}``; ``HORA_CONFIG`` names another file), which
``hora up`` writes.
"""

from __future__ import annotations

import functools
import json
import ssl
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from hora.client_config import ClientConfig, config_path, load_config, save_config
from hora.errors import HoraError, SpecError
from hora.export import DEFAULT_EXPORT, Export, client_python, with_export
from hora.service_wire import Health, JobList, JobScaling
from hora.spec import JobInfo, JobSpec, JobState, QueueEntry, SlotInfo, error_message
from hora.sse import SseEvent, parse_sse

__all__ = [
    "Client",
    "ClientConfig",
    "Job",
    "JobInfo",
    "JobWaitTimeout",
    "LogChunk",
    "ServiceError",
    "ServiceUnavailable",
    "config_path",
    "load_config",
    "parse_spec",
    "save_config",
]


class ServiceError(HoraError):
    """The service answered with an error status (401, 404, 422, 413, 5xx).

    Attributes:
        status: the HTTP status code.
        detail: the service's explanation (a string, or FastAPI's list of field errors).
        url: the request URL.
        code: what code may act on, when the service gave one (``"engine_running"``, ...).
    """

    def __init__(self, status: int, detail: Any, url: str, code: str | None = None) -> None:
        super().__init__(f"{_status_hint(status)} ({status}) from {url}: {render_detail(detail)}")
        self.status = status
        self.detail = detail
        self.url = url
        self.code = code  # the service's machine-readable code (e.g. "engine_running"), if any


class ServiceUnavailable(HoraError, ConnectionError):
    """The service could not be reached (refused, DNS, timeout); the message names the URL."""

    def __init__(self, url: str, cause: str) -> None:
        super().__init__(
            f"cannot reach the hora service at {url}: {cause} "
            "(is `hora serve` / `hora up` running? check HORA_URL or ~/.hora/config)"
        )
        self.url = url
        self.cause = cause


class JobWaitTimeout(HoraError, TimeoutError):
    """:meth:`Job.wait` gave up before the job reached a terminal state."""

    def __init__(self, job_id: int, state: str, timeout: float) -> None:
        super().__init__(f"job {job_id} is still {state} after {timeout:g}s")
        self.job_id = job_id
        self.state = state
        self.timeout = timeout


def _status_hint(status: int) -> str:
    hints = {
        401: "authentication failed (missing or bad token; set HORA_TOKEN)",
        404: "not found",
        413: "request too large",
        422: "invalid request",
    }
    return hints.get(status, "service error")


def render_detail(detail: Any) -> str:
    """One readable line from FastAPI's ``detail`` (a string or a list of field errors)."""
    if isinstance(detail, list):
        parts = []
        for err in detail:
            if isinstance(err, Mapping):
                loc = [str(p) for p in err.get("loc", []) if p not in ("body", "query", "path")]
                field = ".".join(loc) or "request"
                parts.append(f"{field}: {err.get('msg', err)}")
            else:
                parts.append(str(err))
        return "; ".join(parts)
    return str(detail)


@functools.cache
def _tls() -> ssl.SSLContext:
    """One verifying TLS context per process (what ``verify=True`` builds for every client).

    Loading the CA bundle costs 45-60 ms; a kernel makes a client per magic and per session
    heartbeat thread, so they share it. ``SSL_CERT_FILE``/``SSL_CERT_DIR`` apply as with
    ``verify=True``, read when the first client is made.
    """
    return httpx.create_ssl_context()


@dataclass(frozen=True)
class LogChunk:
    """A piece of one rank's log: ``text`` ends at byte ``offset`` of attempt ``attempt``."""

    text: str
    offset: int
    attempt: int | None


class Client:
    """Talks to one hora service with one token.

    Args:
        url: service URL (default ``HORA_URL``, ``~/.hora/config``, ``http://127.0.0.1:8000``).
        token: bearer token (default ``HORA_TOKEN`` or ``~/.hora/config``).
        timeout: seconds for connect/read of one request (log streams use no read timeout).

    Example:
        >>> import hora
        >>> client = hora.Client("http://127.0.0.1:8000", token)  # doctest: +SKIP
        >>> job = client.submit(["python", "train.py"], workers=2)  # doctest: +SKIP
        >>> job.wait(600).state  # doctest: +SKIP
        <JobState.succeeded: 'succeeded'>
    """

    def __init__(
        self, url: str | None = None, token: str | None = None, timeout: float = 30.0
    ) -> None:
        cfg = load_config(url, token)
        self.url = cfg.url
        self.token = cfg.token
        headers = {"Authorization": f"Bearer {cfg.token}"} if cfg.token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout,
                                  verify=_tls())

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send one request; turn transport failures and error statuses into hora errors.

        Args:
            method: HTTP method.
            path: path under the service URL, e.g. ``/v1/jobs``.
            **kwargs: passed to ``httpx.Client.request`` (``json``, ``params``, ``headers``).

        Returns:
            The response (status < 400).

        Raises:
            ServiceUnavailable: the service could not be reached.
            ServiceError: the service answered 4xx/5xx.
        """
        full = f"{self.url}{path}"
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise ServiceUnavailable(full, _transport_cause(e)) from e
        _raise_for_status(resp)
        return resp

    def submit_spec(self, spec: JobSpec) -> Job:
        """Submit a ready :class:`JobSpec`; an existing ``submission_id`` returns its job."""
        body = spec.model_dump(mode="json", exclude_none=True)
        info = JobInfo.model_validate(self.request("POST", "/v1/jobs", json=body).json())
        return Job(self, info.id, info)

    def submit(
        self,
        command: Sequence[str],
        workers: int = 1,
        gpus: int = 1,
        name: str = "job",
        env: Mapping[str, str] | None = None,
        export: Export = DEFAULT_EXPORT,
        **fields: Any,
    ) -> Job:
        """Submit ``command`` as a job of ``workers`` processes with ``gpus`` GPUs each.

        Like ``hora submit``, the job takes this process's ``PATH`` (with this Python's
        directory first when it runs in a virtual environment), ``VIRTUAL_ENV`` and
        ``CONDA_PREFIX``, and runs in the current directory when that lies under the
        service's work root (see :mod:`hora.export`).

        Args:
            command: argv list, e.g. ``["python", "train.py", "--epochs", "3"]`` (no shell).
            workers: number of processes (ranks).
            gpus: GPUs (or CPU slots) per worker.
            name: job name.
            env: extra environment variables for every rank (they win over exported ones).
            export: what the job takes from here, as ``sbatch --export``: names (a sequence,
                or one comma-separated string), or ``"NONE"`` for nothing.
            **fields: other :class:`JobSpec` fields (``priority``, ``max_retries``,
                ``timeout_s``, ``working_dir``, ``submission_id``, ``runtime``, ``image``).

        Returns:
            The submitted :class:`Job`.

        Raises:
            SpecError: the description is invalid (names the field); nothing was sent.
            ServiceError: the service refused it (e.g. 422 asking for more GPUs than exist).

        Example:
            >>> job = client.submit(["python", "train.py"], workers=2, gpus=1)  # doctest: +SKIP
        """
        if isinstance(command, str):
            raise SpecError("command", "must be a list of arguments, not a string (no shell)")
        data = dict(fields, command=list(command), workers=workers, gpus_per_worker=gpus, name=name)
        data["env"] = dict(env or {})
        return self.submit_spec(parse_spec(with_export(data, export, interpreter=client_python())))

    def job(self, job_id: int) -> Job:
        """A handle on an existing job (checks that it exists and is visible to us)."""
        return Job(self, job_id, self.get_job(job_id))

    def get_job(self, job_id: int) -> JobInfo:
        """Fetch the job's current record."""
        return JobInfo.model_validate(self.request("GET", f"/v1/jobs/{int(job_id)}").json())

    def jobs(
        self, state: str | None = None, limit: int = 50, offset: int = 0
    ) -> tuple[list[JobInfo], int]:
        """List jobs visible to us, newest first.

        Args:
            state: only jobs in this state.
            limit: page size (the service caps it).
            offset: jobs to skip.

        Returns:
            The page of jobs and the total number matching.
        """
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if state:
            params["state"] = JobState(state).value
        data = self.request("GET", "/v1/jobs", params=params).json()
        page = JobList[JobInfo].model_validate(data)
        return page.items, page.total

    def handoff(self, session_id: int, spec: JobSpec) -> Job:
        """Submit ``spec`` and hand it the running session's slots (the session stops)."""
        body = spec.model_dump(mode="json", exclude_none=True)
        info = JobInfo.model_validate(
            self.request("POST", f"/v1/sessions/{int(session_id)}/handoff", json=body).json()
        )
        return Job(self, info.id, info)

    def queue(self) -> list[QueueEntry]:
        """The queue in order; our entries carry their reason (another user's only a place).

        An older service without ``/v1/queue`` answers an empty list.
        """
        try:
            data = self.request("GET", "/v1/queue").json()
        except ServiceError as e:
            if e.status == 404:
                return []
            raise
        return [QueueEntry.model_validate(e) for e in data]

    def scaling(self, job_id: int) -> JobScaling:
        """A job's scaling report from its timeline (``GET /v1/jobs/{id}/scaling``).

        Raises:
            ServiceError: 404 when the job is not yours or has no timeline.
        """
        return JobScaling.model_validate(self.request("GET", f"/v1/jobs/{job_id}/scaling").json())

    def gpus(self) -> list[SlotInfo]:
        """Every GPU / CPU slot and who holds it; then the parked sessions (holding none)."""
        return [SlotInfo.model_validate(row) for row in self.request("GET", "/v1/gpus").json()]

    def health(self) -> Health:
        """The service's ``/healthz`` answer (no token needed)."""
        return Health.model_validate(self.request("GET", "/healthz").json())

    def read_logs(
        self, job_id: int, rank: int = 0, offset: int = 0, attempt: int | None = None
    ) -> LogChunk:
        """Read what exists of one rank's log from ``offset`` (one bounded response)."""
        params: dict[str, Any] = {"rank": rank, "offset": offset}
        if attempt is not None:
            params["attempt"] = attempt
        resp = self.request("GET", f"/v1/jobs/{int(job_id)}/logs", params=params)
        att = resp.headers.get("X-Hora-Attempt")
        return LogChunk(
            text=resp.content.decode("utf-8", errors="replace"),
            offset=int(resp.headers.get("X-Hora-Next-Offset", offset + len(resp.content))),
            attempt=int(att) if att not in (None, "") else None,
        )

    def stream_logs(
        self,
        job_id: int,
        rank: int = 0,
        offset: int = 0,
        attempt: int | None = None,
        reconnects: int = 5,
    ) -> Iterator[LogChunk]:
        """Follow one rank's log of one attempt over Server-Sent Events until it ends.

        Reconnects (resuming from the last received offset) when the connection drops.

        Args:
            job_id: the job.
            rank: which rank's log.
            offset: byte offset to start from.
            attempt: which attempt (default: the current one).
            reconnects: how many dropped connections to resume before giving up.

        Yields:
            Log chunks in order; the stream ends when the attempt is over and drained.

        Raises:
            ServiceUnavailable: the connection failed more than ``reconnects`` times.
            ServiceError: the service refused the request (401, 404, 422).
        """
        path = f"/v1/jobs/{int(job_id)}/logs"
        failures = 0
        while True:
            params: dict[str, Any] = {"rank": rank, "offset": offset, "follow": "true"}
            if attempt is not None:
                params["attempt"] = attempt
            try:
                for event in self._sse(path, params):
                    failures = 0
                    if event.event == "end":
                        return
                    if event.event == "attempt":
                        attempt = int(json.loads(event.data)["attempt"])
                        continue
                    offset = int(event.id) if event.id else offset
                    yield LogChunk(json.loads(event.data), offset, attempt)
                return
            except ServiceUnavailable:
                failures += 1
                if failures > reconnects:
                    raise
                time.sleep(min(0.2 * 2**failures, 3.0))

    def _sse(self, path: str, params: dict[str, Any]) -> Iterator[SseEvent]:
        full = f"{self.url}{path}"
        timeout = httpx.Timeout(self._http.timeout.connect or 30.0, read=None)
        try:
            with self._http.stream("GET", path, params=params, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _raise_for_status(resp)
                yield from parse_sse(resp.iter_lines())
        except httpx.TransportError as e:
            raise ServiceUnavailable(full, _transport_cause(e)) from e


class Job:
    """A submitted job: a handle holding the client and the job id.

    Example:
        >>> job = client.submit(["python", "train.py"], workers=2)  # doctest: +SKIP
        >>> job.wait(timeout=600).state  # doctest: +SKIP
        <JobState.succeeded: 'succeeded'>
    """

    def __init__(self, client: Client, job_id: int, info: JobInfo | None = None) -> None:
        self.client = client
        self.id = int(job_id)
        self.info = info

    def __repr__(self) -> str:
        state = self.info.state.value if self.info else "?"
        return f"<hora.Job {self.id} {state} at {self.client.url}>"

    def status(self) -> JobInfo:
        """Fetch the current record (state, attempt, per-rank exit codes, reason, times)."""
        self.info = self.client.get_job(self.id)
        return self.info

    @property
    def state(self) -> JobState:
        """The current state (one request)."""
        return self.status().state

    def logs(self, rank: int = 0, follow: bool = False, attempt: int | None = None) -> str:
        """One rank's log text.

        Args:
            rank: which rank.
            follow: if True, wait until the job ends and return its whole log (every
                attempt's, in order).
            attempt: which attempt (default: the current one).

        Returns:
            The log text (without follow, what exists now, up to the service's bound per
            request; pages are fetched until the end).
        """
        if follow:
            return "".join(self.follow(rank, attempt))
        parts, offset = [], 0
        while True:
            chunk = self.client.read_logs(self.id, rank, offset, attempt)
            parts.append(chunk.text)
            if chunk.offset <= offset or not chunk.text:
                return "".join(parts)
            offset = chunk.offset

    def follow(
        self,
        rank: int = 0,
        attempt: int | None = None,
        on_state: Callable[[JobInfo], None] | None = None,
        poll: float = 0.3,
    ) -> Iterator[str]:
        """Yield one rank's log text live until the job ends.

        Waits while the job is queued, then follows each attempt in turn (a retried job
        has one log per attempt), every one of them: also an attempt that began and ended
        between two looks at the job.

        Args:
            rank: which rank.
            attempt: follow only this attempt.
            on_state: called with the record whenever the state or attempt changes.
            poll: seconds between status checks while no log is being followed.

        Yields:
            Pieces of log text, in order.
        """
        if attempt is not None:
            for chunk in self.client.stream_logs(self.id, rank, attempt=attempt):
                yield chunk.text
            return
        last: tuple[JobState, int] | None = None
        followed = 0  # attempts 1..followed were followed to their end
        while True:
            info = self.status()
            if on_state is not None and (info.state, info.attempt) != last:
                on_state(info)
            last = (info.state, info.attempt)
            if followed < info.attempt:  # each attempt in order, none skipped
                followed += 1
                for chunk in self.client.stream_logs(self.id, rank, attempt=followed):
                    yield chunk.text
                continue
            if info.state.terminal:
                return
            time.sleep(poll)

    def wait(self, timeout: float | None = 3600.0, poll: float = 0.5) -> JobInfo:
        """Block until the job is succeeded, failed or cancelled.

        Args:
            timeout: seconds to wait (None waits forever).
            poll: seconds between status requests.

        Returns:
            The final record; check ``.state`` (wait does not raise on a failed job).

        Raises:
            JobWaitTimeout: the job was not terminal after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            info = self.status()
            if info.state.terminal:
                return info
            if deadline is not None and time.monotonic() >= deadline:
                raise JobWaitTimeout(self.id, info.state.value, float(timeout or 0))
            time.sleep(poll)

    def cancel(self) -> JobInfo:
        """Ask the service to cancel the job (no-op if it already ended)."""
        data = self.client.request("POST", f"/v1/jobs/{self.id}/cancel").json()
        self.info = JobInfo.model_validate(data)
        return self.info

    def delete(self) -> None:
        """Remove a finished job and its logs from the service."""
        self.client.request("DELETE", f"/v1/jobs/{self.id}")


def parse_spec(data: Mapping[str, Any]) -> JobSpec:
    """Validate a job description into a :class:`JobSpec`, naming the first bad field.

    Args:
        data: spec fields.

    Returns:
        The frozen spec.

    Raises:
        SpecError: a field is invalid; ``field`` names it.

    Example:
        >>> parse_spec({"command": ["python", "x.py"], "workers": 2}).workers
        2
    """
    try:
        return JobSpec.model_validate(dict(data))
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "spec"
        raise SpecError(field, error_message(err)) from None


def _raise_for_status(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    code = None
    try:
        body = resp.json()
        detail: Any = body.get("detail", resp.text)
        code = body.get("code") if isinstance(body.get("code"), str) else None
    except (ValueError, AttributeError):
        detail = resp.text[:500] or resp.reason_phrase
    raise ServiceError(resp.status_code, detail, str(resp.request.url), code)


def _transport_cause(e: httpx.TransportError) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, httpx.TimeoutException):
        return f"timed out ({text})"
    return text
