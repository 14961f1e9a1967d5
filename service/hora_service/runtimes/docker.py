"""The docker runtime: one container per attempt and host, with the job's GPUs (control plane).

Like Determined, SkyPilot and dstack, a job gets **one container per host** with all of its
GPUs on that host (``--gpus device=...``), the host's network and a large ``/dev/shm``: NCCL's
CUDA-IPC and NVLink paths need ranks that see each other's GPUs, which containers of one
GPU each never do. The container's init (:mod:`hora_service.runtimes.container_init`) starts
every rank under the same rank shim as the local runtime, so logs, pid/exit files, exit codes,
signals and ``HORA_RESTART_COUNT`` behave exactly as in ``local``.

Only the job's working directory (at the same path) and the attempt's run directory (logs,
launch and exit files) are bind-mounted; hora itself comes from the image. The container runs
as the job's account (never root, no capabilities, ``no-new-privileges``, never the Docker
socket), with the rank environment of :func:`~hora_service.runtimes.local.rank_environment`
over the image's own. Containers carry the labels ``hora.instance``, ``hora.job`` and
``hora.attempt``: a restarted service finds its running containers again and removes the ones
whose attempt has ended. The Engine API is reached through the ``docker`` SDK; what the
container is made of is a pure function (:func:`container_config`).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests.exceptions
from docker.types import DeviceRequest, Mount, Ulimit
from hora.errors import HoraError, SpecError
from hora.spec import JobSpec

from hora_service.identity import RunAs
from hora_service.runtimes.base import AttemptPlan, Exit, RankProcess, RankStatus, Runtime
from hora_service.runtimes.containment import instance_id
from hora_service.runtimes.local import ALLOWED, ALLOWED_PREFIXES, rank_environment, read_exit
from hora_service.settings import Settings

log = logging.getLogger(__name__)

# the container's init, found next to hora_service in the image and run by its path: importing
# hora_service.runtimes would load the service's dependencies, which a job image may lack
INIT = (
    "import os, runpy, hora_service; runpy.run_path(os.path.join(os.path.dirname("
    "hora_service.__file__), 'runtimes', 'container_init.py'), run_name='__main__')"
)
LABEL = "hora"
STATE_TTL_S = 0.2  # how long one answer of the engine about a container is reused
UNKNOWN_TTL_S = 2.0  # an engine that does not answer is asked again only this often
ENGINE_GRACE_S = 15.0  # an engine that does not answer for this long has lost its ranks
API_TIMEOUT_S = 30
CONTAINER_HOME = "/tmp"  # the account's home on the host is not mounted
# what the engine's errors look like when it cannot be reached
UNREACHABLE = (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


class EngineError(HoraError):
    """The Docker engine cannot do what an attempt needs (down, image missing, refused)."""


@dataclass(frozen=True)
class DockerConfig:
    """The docker settings of the service (see :class:`~hora_service.settings.Settings`).

    Example:
        >>> config = DockerConfig(instance="ab12")
        >>> config.allows("hora:cpu"), config.allows("evil/miner:latest")
        (True, False)
    """

    instance: str
    host: str | None = None
    allowed_images: tuple[str, ...] = ("hora:*", "hora-*:*")
    pull: str = "if-not-present"
    shm_size: str = "4g"
    ipc: str = "private"
    network: str = "host"
    ulimits: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    uid: int = 65534
    passthrough: tuple[str, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, s: Settings, environ: Mapping[str, str] | None = None) -> DockerConfig:
        """Read the ``docker_*`` settings; the engine is ``DOCKER_HOST`` when none is set."""
        environ = os.environ if environ is None else environ
        return cls(
            instance=instance_id(s.data_dir),
            host=s.docker_host or environ.get("DOCKER_HOST") or None,
            allowed_images=tuple(s.docker_allowed_images),
            pull=s.docker_pull,
            shm_size=s.docker_shm_size,
            ipc=s.docker_ipc,
            network=s.docker_network,
            ulimits=tuple(s.docker_ulimits),
            devices=tuple(s.docker_devices),
            uid=s.docker_uid,
            passthrough=tuple(s.job_env_passthrough),
        )

    def allows(self, image: str) -> bool:
        """Whether ``image`` matches one of the allowed patterns."""
        return any(fnmatch.fnmatchcase(image, p) for p in self.allowed_images)


def parse_ulimit(text: str) -> Ulimit:
    """``NAME=SOFT[:HARD]`` as a Docker ulimit (``-1``: unlimited).

    Raises:
        ValueError: not of that form.

    Example:
        >>> u = parse_ulimit("memlock=-1"); (u.name, u.soft, u.hard)
        ('memlock', -1, -1)
    """
    name, sep, values = text.partition("=")
    soft, _, hard = values.partition(":")
    try:
        if not sep or not name.strip():
            raise ValueError
        return Ulimit(name=name.strip(), soft=int(soft), hard=int(hard or soft))
    except ValueError:
        raise ValueError(f"ulimit {text!r} is not NAME=SOFT[:HARD]") from None


def labels(config: DockerConfig, job_id: int, attempt: int | None = None) -> dict[str, str]:
    """The labels of one attempt's container (``attempt=None``: any attempt of the job).

    Example:
        >>> labels(DockerConfig(instance="ab12"), 7, 2)
        {'hora.instance': 'ab12', 'hora.job': '7', 'hora.attempt': '2'}
    """
    out = {f"{LABEL}.instance": config.instance, f"{LABEL}.job": str(int(job_id))}
    if attempt is not None:
        out[f"{LABEL}.attempt"] = str(int(attempt))
    return out


def container_name(config: DockerConfig, job_id: int, attempt: int) -> str:
    """The container's name: unique per service instance, job and attempt.

    Example:
        >>> container_name(DockerConfig(instance="ab12"), 7, 2)
        'hora-ab12-7-2'
    """
    return f"hora-{config.instance}-{int(job_id)}-{int(attempt)}"


def job_account(plan: AttemptPlan, config: DockerConfig, euid: int | None = None) -> RunAs:
    """The account the container runs as: the job's, else ``docker_uid`` (never root).

    A service that is not root runs containers as its own account (it is unprivileged, and
    it cannot hand the run directory to another).
    """
    if plan.run_as is not None:
        return plan.run_as
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return RunAs(uid=euid, gid=os.getegid(), home=Path(CONTAINER_HOME), user=str(euid))
    return RunAs(uid=config.uid, gid=config.uid, home=Path(CONTAINER_HOME), user=str(config.uid))


def container_env(
    plan: AttemptPlan,
    rank: int,
    image_env: Sequence[str],
    service_env: Mapping[str, str],
    passthrough: Sequence[str] = (),
) -> dict[str, str]:
    """The environment of rank ``rank`` inside the container.

    The image's own environment (its ``PATH`` finds the image's Python), the service's
    locale variables and the admin's pass-through names (never its ``PATH`` or ``HOME``:
    they name host paths), then the rank variables as for a local job. ``HOME`` is ``/tmp``
    (the account's home is not mounted), and ``CUDA_VISIBLE_DEVICES`` counts the container's
    GPUs from 0, as the engine renumbers them.
    """
    base = dict(e.split("=", 1) for e in image_env if "=" in e)
    host_only = {"PATH", "HOME", "USER", "LOGNAME"}
    base.update(
        {
            k: v
            for k, v in service_env.items()
            if k not in host_only and (k in ALLOWED or k.startswith(ALLOWED_PREFIXES))
        }
    )
    base.update({k: service_env[k] for k in passthrough if k in service_env and k != "PATH"})
    env = rank_environment(plan, rank, base)
    env["HOME"] = CONTAINER_HOME
    if plan.slot_kind == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(plan.slots)))
    return env


def container_config(plan: AttemptPlan, config: DockerConfig, who: RunAs) -> dict[str, Any]:
    """The keyword arguments of ``containers.create`` for one attempt (pure).

    Args:
        plan: the attempt.
        config: the service's docker settings.
        who: the account the container runs as.

    Returns:
        Keyword arguments for :meth:`docker.models.containers.ContainerCollection.create`.

    Raises:
        SpecError: the job names no image (field ``image``).

    Example:
        >>> container_config(plan, config, who)["user"]  # doctest: +SKIP
        '1001:1001'
    """
    if plan.spec.image is None:
        raise SpecError("image", "a docker job must name an image")
    run_dir, workdir = str(plan.run_dir), str(plan.workdir)
    mounts = [Mount(target=workdir, source=workdir, type="bind")]
    if not plan.run_dir.is_relative_to(plan.workdir):
        mounts.append(Mount(target=run_dir, source=run_dir, type="bind"))
    gpus = [str(s) for s in plan.slots] if plan.slot_kind == "gpu" else []
    return {
        "image": plan.spec.image,
        "entrypoint": ["python", "-I", "-c", INIT],
        "command": [run_dir],
        "name": container_name(config, plan.job_id, plan.attempt),
        "labels": {**labels(config, plan.job_id, plan.attempt), **config.labels},
        "user": f"{who.uid}:{who.gid}",
        "working_dir": workdir,
        "environment": {},
        "mounts": mounts,
        "network_mode": config.network,
        "ipc_mode": config.ipc,
        "shm_size": config.shm_size,
        "ulimits": [parse_ulimit(u) for u in config.ulimits],
        "devices": [f"{d}:{d}:rwm" for d in config.devices],
        "device_requests": [DeviceRequest(device_ids=gpus, capabilities=[["gpu"]])] if gpus else [],
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "privileged": False,
        "stdin_open": False,
        "tty": False,
        "detach": True,
    }


class Box:
    """One attempt's container as its ranks see it: its state, asked at most every 0.2 s."""

    def __init__(self, runtime: DockerRuntime, plan: AttemptPlan, container_id: str | None):
        self.runtime = runtime
        self.plan = plan
        self.id = container_id
        self._state: tuple[float, str | None] = (-1.0, None)
        self._unreachable_since: float | None = None
        self._signalled: dict[int, float] = {}
        self.why: str | None = None

    def state(self) -> str:
        """``running``, ``exited`` (or gone), or ``unknown`` while the engine does not answer."""
        now = time.monotonic()
        last, known = self._state
        ttl = UNKNOWN_TTL_S if known == "unknown" else STATE_TTL_S
        if known is not None and now - last < ttl:
            return known
        try:
            found = self.runtime.find(self.plan)
        except UNREACHABLE as e:
            self._unreachable_since = self._unreachable_since or now
            self.why = f"the Docker engine stopped answering ({_short(e)})"
            self._state = (now, "unknown")
            return "unknown"
        self._unreachable_since = None
        if found is None:
            state = "exited"
            self.why = "its container is gone"
        else:
            self.id = found.id
            alive = found.status in ("created", "running", "restarting", "paused")
            state = "running" if alive else "exited"
            if state == "exited":
                result = found.attrs.get("State", {})
                self.why = (
                    "its container was killed for lack of memory"
                    if result.get("OOMKilled")
                    else f"its container ended with code {result.get('ExitCode')} first"
                )
        self._state = (now, state)
        return state

    def engine_lost(self) -> bool:
        """The engine has not answered for :data:`ENGINE_GRACE_S`."""
        since = self._unreachable_since
        return since is not None and time.monotonic() - since > ENGINE_GRACE_S

    def signal(self, sig: int) -> None:
        """Signal the container's init (it passes the signal to every rank), once per pass."""
        now = time.monotonic()
        if now - self._signalled.get(sig, -1.0) < STATE_TTL_S:
            return  # the manager signals each rank; the container needs it once
        self._signalled[sig] = now
        try:
            found = self.runtime.find(self.plan)
            if found is not None and found.status == "running":
                found.kill(signal=int(sig))
        except UNREACHABLE as e:
            log.warning("job %d: cannot signal its container: %s", self.plan.job_id, _short(e))


class DockerRank(RankProcess):
    """One rank in an attempt's container: its exit file, else the container's state."""

    def __init__(self, rank: int, box: Box) -> None:
        self.rank = rank
        self.box = box
        self.container_id = box.id

    def poll(self) -> RankStatus:
        """The shim's recorded exit code; ``running`` while the container runs; else ``lost``."""
        run_dir = self.box.plan.run_dir
        recorded = read_exit(run_dir, self.rank)
        if recorded is not None:
            if recorded < 0 and self.box.state() == "unknown":
                self.note = self.box.why  # killed, and the engine is gone
            return recorded
        state = self.box.state()
        self.container_id = self.box.id
        if state == "running" or (state == "unknown" and not self.box.engine_lost()):
            return Exit.running
        recorded = read_exit(run_dir, self.rank)  # it may have ended between the looks
        if recorded is not None:
            return recorded
        self.note = self.box.why
        return Exit.lost

    def signal(self, sig: int) -> None:
        """Signal the container (SIGTERM reaches every rank through its init)."""
        self.box.signal(sig)


class DockerRuntime(Runtime):
    """One container per attempt on this host (see the module docstring)."""

    name = "docker"

    def __init__(self, config: DockerConfig, service_env: Mapping[str, str] | None = None):
        self.config = config
        self.service_env = dict(os.environ if service_env is None else service_env)
        self._client: docker.DockerClient | None = None
        self._unremoved: dict[tuple[int, int], AttemptPlan] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> DockerRuntime:
        """The runtime with the service's docker settings (the engine is not contacted yet)."""
        return cls(DockerConfig.from_settings(settings))

    @property
    def client(self) -> docker.DockerClient:
        """The Engine API client (built at first use, so a missing engine fails attempts only)."""
        if self._client is None:
            host = self.config.host or "unix:///var/run/docker.sock"
            self._client = docker.DockerClient(base_url=host, timeout=API_TIMEOUT_S)
        return self._client

    def _check(self, spec: JobSpec) -> None:
        if spec.image is None:
            raise SpecError("image", "the docker runtime needs an image (--image)")
        if not self.config.allows(spec.image):
            allowed = ", ".join(self.config.allowed_images) or "none"
            raise SpecError(
                "image",
                f"image {spec.image!r} is not allowed on this service (allowed: {allowed}); "
                "an admin can add patterns to HORA_DOCKER_ALLOWED_IMAGES",
            )

    def find(self, plan: AttemptPlan) -> Any:
        """The attempt's container, or None (raises what the SDK raises when the engine is down)."""
        found = self.client.containers.list(
            all=True, filters={"label": _filters(labels(self.config, plan.job_id, plan.attempt))}
        )
        return found[0] if found else None

    def _image_env(self, image: str) -> list[str]:
        """The image's environment, pulling it first when the policy allows."""
        try:
            found = self.client.images.get(image)
        except docker.errors.ImageNotFound:
            if self.config.pull == "never":
                raise EngineError(
                    f"image {image!r} is not on the Docker engine and the pull policy is never"
                ) from None
            try:
                found = self.client.images.pull(image)
            except UNREACHABLE as e:
                raise EngineError(f"cannot pull image {image!r}: {_short(e)}") from None
        env = (found.attrs.get("Config") or {}).get("Env") or []
        return [str(e) for e in env]

    def _start(self, plan: AttemptPlan, base_env: dict[str, str]) -> list[RankProcess]:
        assert plan.spec.image is not None
        who = job_account(plan, self.config)
        try:
            image_env = self._image_env(plan.spec.image)
            self._sweep()
            self._remove(plan)  # one left by a service that died while starting this attempt
            ranks = list(range(plan.spec.workers))
            self._write_run_files(plan, who, image_env, ranks)
            created = self.client.containers.create(**container_config(plan, self.config, who))
            try:
                created.start()
            except UNREACHABLE:
                created.remove(force=True)
                raise
        except EngineError:
            raise
        except UNREACHABLE as e:
            where = self.config.host or "the default socket"
            raise EngineError(f"the Docker engine at {where} failed: {_short(e)}") from None
        box = Box(self, plan, created.id)
        log.info("job %d attempt %d: container %s", plan.job_id, plan.attempt, created.short_id)
        return [DockerRank(rank, box) for rank in ranks]

    def _write_run_files(
        self, plan: AttemptPlan, who: RunAs, image_env: Sequence[str], ranks: Sequence[int]
    ) -> None:
        """The container's ``container.json`` and each rank's launch file, for the job's group.

        In the container the shim runs as the job's account: it reads its launch file and
        writes the logs and pid/exit files, so the run directory is group-writable there.
        """
        _group_file(plan.run_dir / "container.json", who.gid, json.dumps(
            {"ranks": list(ranks), "command": list(plan.spec.command)}
        ))  # fmt: skip
        for rank in ranks:
            launch: dict[str, object] = {
                "env": container_env(
                    plan, rank, image_env, self.service_env, self.config.passthrough
                ),
                "uid": None,  # the container already runs as the job's account
                "gid": None,
                "cgroups": [],  # the container is the attempt's cgroup
                "log_limit": plan.rank_log_bytes,
            }
            _group_file(plan.run_dir / f"rank{rank}.launch", who.gid, json.dumps(launch))
        if os.geteuid() == 0:
            os.chown(plan.run_dir, -1, who.gid)
        plan.run_dir.chmod(0o770)

    def _adopt(self, plan: AttemptPlan) -> list[RankProcess]:
        box = Box(self, plan, None)
        box.state()
        return [DockerRank(rank, box) for rank in range(plan.spec.workers)]

    def _clear(self, plan: AttemptPlan) -> bool:
        """Remove the attempt's container; with the engine gone, nothing of it can run.

        A container the engine could not remove (it was down) is removed by a later start.
        """
        try:
            self._sweep()
            return self._remove(plan)
        except UNREACHABLE as e:
            log.warning(
                "job %d attempt %d: the Docker engine does not answer (%s); its container "
                "cannot run without it and is removed once the engine is back",
                plan.job_id, plan.attempt, _short(e),
            )  # fmt: skip
            self._unremoved[(plan.job_id, plan.attempt)] = plan
            return True

    def _sweep(self) -> None:
        """Remove the containers left while the engine was down."""
        for key, plan in list(self._unremoved.items()):
            if self._remove(plan):
                del self._unremoved[key]

    def _remove(self, plan: AttemptPlan) -> bool:
        """Kill and remove the attempt's container; True once there is none."""
        for found in self.client.containers.list(
            all=True, filters={"label": _filters(labels(self.config, plan.job_id, plan.attempt))}
        ):
            try:
                found.remove(force=True)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:
                if "already in progress" not in str(e):
                    raise
                return False
        return True


def _filters(wanted: Mapping[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in wanted.items()]


def _group_file(path: Path, gid: int, text: str) -> None:
    """Write ``path`` as the service's, readable by group ``gid`` only (mode 0640)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o640)
    try:
        os.fchmod(fd, 0o640)
        if os.geteuid() == 0 or gid == os.getegid():
            os.fchown(fd, -1, gid)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__

