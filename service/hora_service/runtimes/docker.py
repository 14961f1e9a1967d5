"""The docker runtime: one container per attempt and host, with the job's GPUs (control plane).

Like Determined, SkyPilot and dstack, a job gets **one container per host** with all of its
GPUs on that host (``--gpus device=...``), a network of its own and a large ``/dev/shm``: NCCL's
CUDA-IPC and NVLink paths need ranks that see each other's GPUs, which containers of one
GPU each never do. The container's init (:mod:`hora_service.runtimes.container_init`) starts
every rank under the same rank shim as the local runtime, so logs, pid/exit files, exit codes,
signals and ``HORA_RESTART_COUNT`` behave exactly as in ``local``.

Only the job's working directory (at the same path) and the attempt's run directory (logs,
launch and exit files) are bind-mounted; hora itself comes from the image. The ranks run as
the job's account (never root, no capabilities, ``no-new-privileges``, never the Docker
socket); with a service running as root, the container's init and the rank shims run as the
container's root with only ``CAP_SETUID``, ``CAP_SETGID`` and ``CAP_KILL``, so the run
directory stays the service's and no rank can rewrite its log or exit file. The ranks run within
the attempt's memory, pids and CPU limits (:func:`~hora_service.runtimes.limits.docker_limits`)
and get the rank environment of :func:`~hora_service.runtimes.core.rank_environment`
over the image's own. Containers carry the labels ``hora.instance``, ``hora.job`` and
``hora.attempt``: a restarted service finds its running containers again and removes the ones
whose attempt has ended. The Engine API is reached through the ``docker`` SDK; what the
container is made of is a pure function (:func:`container_config`).
"""

from __future__ import annotations

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
from docker.types import DeviceRequest, Mount, Ulimit
from hora.errors import SpecError
from hora.spec import JobSpec, SlotKind

from hora_service.identity import RunAs
from hora_service.runtimes.base import AttemptPlan, Exit, RankProcess, RankStatus, Runtime
from hora_service.runtimes.containment import CGROUP_FS, instance_id, tree_cpu_seconds
from hora_service.runtimes.core import allowed_env, rank_environment, read_exit
from hora_service.runtimes.docker_images import (
    UNREACHABLE,
    DockerEngineError,
    check_image,
    resolve_image,
)
from hora_service.runtimes.docker_images import short as _short
from hora_service.runtimes.imageref import IMAGE_ID, ImageRef
from hora_service.runtimes.limits import Hits, counter, docker_limits, recorded_hits, tmp_mounts
from hora_service.scheduling.reasons import image_reason
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
INIT_CAPS = ("SETUID", "SETGID", "KILL")  # all the container's root keeps: drop uid, signal


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
        """Whether ``image``, normalized, matches an allowed pattern (see ``imageref``).

        Raises:
            SpecError: (field ``image``) not a valid image reference.
        """
        if IMAGE_ID.match(image):
            return image in self.allowed_images
        return ImageRef.parse(image).allowed(self.allowed_images)

    def pulls(self, image: str) -> bool:
        """Whether ``image`` may be pulled: the policy allows it, its pattern names a registry."""
        if self.pull == "never" or IMAGE_ID.match(image):
            return False
        return ImageRef.parse(image).pullable(self.allowed_images)


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
    base.update({k: v for k, v in allowed_env(service_env).items() if k not in host_only})
    base.update({k: service_env[k] for k in passthrough if k in service_env and k != "PATH"})
    env = rank_environment(plan, rank, base)
    env["HOME"] = CONTAINER_HOME
    if plan.slot_kind == SlotKind.gpu:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(plan.slots)))
    return env


def container_config(
    plan: AttemptPlan, config: DockerConfig, who: RunAs, root_init: bool = True
) -> dict[str, Any]:
    """The keyword arguments of ``containers.create`` for one attempt (pure).

    With ``root_init`` (a service running as root) the container's init runs as the
    container's root with only ``CAP_SETUID``, ``CAP_SETGID`` and ``CAP_KILL``: it owns the run
    directory and its shims drop each rank to ``who`` (see
    :mod:`~hora_service.runtimes.container_init`). Without it (a service that cannot give
    the run directory to anyone else) everything runs as ``who`` with no capability. Either
    way ``no-new-privileges`` holds, so no rank regains what was dropped.

    Args:
        plan: the attempt.
        config: the service's docker settings.
        who: the account the ranks run as.
        root_init: run the init and the shims as the container's root (see above).

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
    gpus = [str(s) for s in plan.slots] if plan.slot_kind == SlotKind.gpu else []
    return {
        "image": plan.spec.image,
        "entrypoint": ["python", "-I", "-c", INIT],
        "command": [run_dir],
        "name": container_name(config, plan.job_id, plan.attempt),
        "labels": {**labels(config, plan.job_id, plan.attempt), **config.labels},
        **_privileges(who, root_init, run_dir, workdir),
        "environment": {},
        "mounts": mounts,
        "network_mode": network_mode(plan, config),
        "ipc_mode": config.ipc,
        "shm_size": config.shm_size,
        "tmpfs": tmp_mounts(plan.tmp_bytes),
        "ulimits": [parse_ulimit(u) for u in config.ulimits],
        "devices": [f"{d}:{d}:rwm" for d in config.devices],
        "device_requests": [DeviceRequest(device_ids=gpus, capabilities=[["gpu"]])] if gpus else [],
        **docker_limits(plan.limits),
        "stdin_open": False,
        "tty": False,
        "detach": True,
    }


def _privileges(who: RunAs, root_init: bool, run_dir: str, workdir: str) -> dict[str, Any]:
    """Who the container's init runs as, where, and with what (see :func:`container_config`)."""
    return {
        "user": "0:0" if root_init else f"{who.uid}:{who.gid}",
        # the shims enter the job's directory as the job's account; the init stays here
        "working_dir": run_dir if root_init else workdir,
        "cap_drop": ["ALL"],
        "cap_add": list(INIT_CAPS) if root_init else [],
        "security_opt": ["no-new-privileges"],
        "privileged": False,
    }


def network_mode(plan: AttemptPlan, config: DockerConfig) -> str:
    """The container's network: ``none`` when the attempt's sockets are to be its own.

    ``none`` gives the container a loopback of its own; otherwise (sessions, whose engines
    reach the notebook's controller, or ``job_private_network`` off) ``docker_network``.

    The runtime runs one container per attempt and host, so a job's ranks, its rendezvous
    store and its gloo / NCCL listeners all meet on that loopback, out of every other
    process's reach.

    Example:
        >>> network_mode(plan, DockerConfig(instance="ab12"))  # doctest: +SKIP
        'none'
    """
    return "none" if plan.private_network else config.network


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
        paths = self.box.plan.paths
        recorded = read_exit(paths, self.rank)
        if recorded is not None:
            if recorded < 0 and self.box.state() == "unknown":
                self.note = self.box.why  # killed, and the engine is gone
            return recorded
        state = self.box.state()
        self.container_id = self.box.id
        if state == "running" or (state == "unknown" and not self.box.engine_lost()):
            return Exit.running
        recorded = read_exit(paths, self.rank)  # it may have ended between the looks
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
    uses_cgroup = False  # the ranks are in the container's cgroup, limited by the engine

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
        check_image(lambda: self.client, self.config, spec.image)

    def find(self, plan: AttemptPlan) -> Any:
        """The attempt's container, or None (raises what the SDK raises when the engine is down)."""
        found = self.client.containers.list(
            all=True, filters={"label": _filters(labels(self.config, plan.job_id, plan.attempt))}
        )
        return found[0] if found else None

    def _start(self, plan: AttemptPlan, base_env: dict[str, str]) -> list[RankProcess]:
        assert plan.spec.image is not None
        who = job_account(plan, self.config)
        try:
            if self.waits is not None:  # the job page says so while the image is pulled
                self.waits.post(plan.job_id, image_reason(plan.spec.image))
            try:
                image_id, image_env = resolve_image(self.client, self.config, plan.spec.image)
            finally:
                if self.waits is not None:
                    self.waits.clear(plan.job_id)
            self._sweep()
            self._remove(plan)  # one left by a service that died while starting this attempt
            ranks = list(range(plan.spec.workers))
            root_init = os.geteuid() == 0
            self._write_run_files(plan, who, image_env, ranks, root_init)
            config = {**container_config(plan, self.config, who, root_init), "image": image_id}
            created = self.client.containers.create(**config)
            try:
                created.start()
            except UNREACHABLE:
                created.remove(force=True)
                raise
        except DockerEngineError:
            raise
        except UNREACHABLE as e:
            where = self.config.host or "the default socket"
            raise DockerEngineError(f"the Docker engine at {where} failed: {_short(e)}") from None
        box = Box(self, plan, created.id)
        log.info("job %d attempt %d: container %s", plan.job_id, plan.attempt, created.short_id)
        return [DockerRank(rank, box) for rank in ranks]

    def _write_run_files(
        self,
        plan: AttemptPlan,
        who: RunAs,
        image_env: Sequence[str],
        ranks: Sequence[int],
        root_init: bool,
    ) -> None:
        """The container's ``container.json`` and each rank's launch file.

        With ``root_init`` the container's root reads them and writes the logs and pid/exit
        files; the run directory stays the service's (mode 0750) and the job's account can
        write nothing in it. Without it the container runs as the service's own account,
        which owns the directory anyway.
        """
        _group_file(plan.paths.container_json, who.gid, json.dumps({"ranks": list(ranks)}))
        for rank in ranks:
            launch: dict[str, object] = {
                "command": list(plan.spec.command),
                "env": container_env(
                    plan, rank, image_env, self.service_env, self.config.passthrough
                ),
                # the shim drops the command to the job's account (else it already is)
                "uid": who.uid if root_init else None,
                "gid": who.gid if root_init else None,
                "cgroups": [],  # the container is the attempt's cgroup
                "log_limit": plan.rank_log_bytes,
                "cwd": str(plan.workdir),
                "umask": plan.umask,
            }
            _group_file(plan.paths.launch(rank), who.gid, json.dumps(launch))
        plan.run_dir.chmod(0o750)

    def _adopt(self, plan: AttemptPlan) -> list[RankProcess]:
        box = Box(self, plan, None)
        box.state()
        return [DockerRank(rank, box) for rank in range(plan.spec.workers)]

    def _cpu_seconds(self, plan: AttemptPlan) -> float | None:
        """CPU time of the container's processes: its init's and every descendant's."""
        try:
            found = self.find(plan)
        except UNREACHABLE:
            return None
        pid = int(((found.attrs.get("State") or {}).get("Pid") or 0) if found else 0)
        return tree_cpu_seconds(pid) if pid > 0 else None

    def limit_hits(self, plan: AttemptPlan) -> Hits:
        """The container's OOM kill (the engine's ``OOMKilled``) and refused forks (its cgroup).

        The engine removes the container's cgroup as soon as its init exits, so what the init
        recorded on its way out (``container.hits``) counts as well.
        """
        recorded = recorded_hits(plan.paths.container_hits)
        try:
            found = self.find(plan)
        except UNREACHABLE:
            return recorded
        if found is None:
            return recorded
        oom = int(bool((found.attrs.get("State") or {}).get("OOMKilled")))
        # the container's cgroup: cgroupfs driver on v1, on v2, and systemd's driver on v2
        v1 = ("{}/docker/" + found.id,)
        v2 = ("docker/" + found.id, f"system.slice/docker-{found.id}.scope")
        for d in (*(w.format("memory") for w in v1), *v2):
            oom = max(oom, counter(CGROUP_FS / d / "memory.oom_control", "oom_kill"))
            oom = max(oom, counter(CGROUP_FS / d / "memory.events", "oom_kill"))
        pids = max(
            counter(CGROUP_FS / d / "pids.events", "max")
            for d in (*(w.format("pids") for w in v1), *v2)
        )
        return Hits(oom_kills=max(oom, recorded.oom_kills), pids_max=max(pids, recorded.pids_max))

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
