"""Settings of the job service (control plane).

One :class:`Settings` object, read from ``HORA_*`` environment variables and arguments, is
built by whoever starts the service (``hora serve``, ``hora up``, a test) and handed down:
nothing reads the environment at import time.

Example:
    >>> Settings(data_dir="/tmp/h", cpu_slots=4).db_path.name
    'hora.db'
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from hora_service.runtimes import limits
from hora_service.runtimes.imageref import check_pattern


def _hub(name: str) -> Any:
    """A hub setting: ``HORA_HUB_<NAME>``, else the ``JUPYTERHUB_<NAME>`` the hub sets."""
    return Field(
        validation_alias=AliasChoices(f"hub_{name}", f"HORA_HUB_{name.upper()}",
                                      f"JUPYTERHUB_{name.upper()}")
    )  # fmt: skip


def service_url(host: str, port: int) -> str:
    """The URL clients use for a service bound to ``host:port``.

    Example:
        >>> service_url("0.0.0.0", 8000)
        'http://127.0.0.1:8000'
    """
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"


class Settings(BaseSettings):
    """Everything the service can be told; each field is ``HORA_<FIELD>`` in the environment.

    Attributes:
        host: address uvicorn listens on.
        port: TCP port.
        data_dir: state directory: the SQLite database and job logs live here.
        gpus: ``auto`` (ask ``nvidia-smi``), a count ``N`` (GPUs ``0..N-1``; ``0`` for none)
            or a list ``0,1,3``.
        cpu_slots: schedulable slots that stand in for GPUs on a machine without any.
        work_root: jobs' working directories must lie under it (default: the home directory).
        user_gpu_quota: most GPUs (slots) one user's running jobs may hold; None = no quota.
        kill_grace_s: seconds between SIGTERM and SIGKILL when a job is cancelled or times out.
        retry_backoff_s: wait before the first retry; doubles for each further attempt.
        monitor_interval_s: seconds between two passes of the monitor loop.
        dev_mode: relax the startup safety checks (never authentication).
        max_request_bytes: largest request body accepted.
        max_log_request_bytes: most log bytes one plain log request returns.
        user_mode: ``auto`` (``multi`` when the service runs as root, else ``single``),
            ``multi`` (each user's jobs run as that user's own OS account), ``single`` (one
            user; jobs run as the service's account) or ``shared`` (several users whose jobs
            all run as the service's account: only for users who trust each other and the
            service). See docs/service/security.md.
        containment: how the processes of an attempt are held and killed: ``auto`` (cgroup
            v2 where it is the mounted hierarchy, else cgroup v1 ``freezer`` + ``pids``, else
            the environment tag), ``cgroup2``, ``cgroup1`` or ``tag``.
        job_private_network: give each job attempt sockets of its own (sessions excepted:
            their engines reach the notebook's controller): in multi-user mode the local
            runtime runs the attempt's ranks in a network namespace with its own loopback and
            a mount namespace with a private ``/tmp``, ``/dev/shm`` and a ``/proc`` that hides
            other accounts' processes (needs root; else a warning and none); the docker
            runtime runs the job's container with ``--network none``.
        job_tmp_paths: directories under ``/tmp`` or ``/dev/shm`` that jobs with a private
            ``/tmp`` (``job_private_network``) still see at their paths, for what jobs run
            from there (Python, hora, a checkout), where the job's account reaches them;
            comma-separated; by default none (the work root, the job's working directory and
            the directories of its ``PATH``, ``PYTHONPATH``, ``VIRTUAL_ENV`` and
            ``CONDA_PREFIX`` its account reaches always stay visible).
        job_env_passthrough: names of the service's environment variables jobs inherit (by
            default none: a job's environment is built from an allow-list).
        log_bytes_per_attempt: most log bytes one attempt keeps, split evenly over its
            ranks; past it a rank's log keeps its newest half after a truncation marker.
        clear_timeout_s: how long the monitor tries to empty an ended attempt's processes
            before it reports the attempt stuck (its slots stay held either way).
        elastic_shrink_timeout_s: how long an elastic job may run more workers than the slots
            it may hold (one asked to shrink for a job of higher priority, or one that started
            more than it was offered) before the service stops its newest extra workers.
        docker_host: the Docker engine's address (``DOCKER_HOST`` convention:
            ``unix:///run/docker.sock``, ``tcp://HOST:PORT``); None: the ``DOCKER_HOST`` of
            the service's environment, else the engine's default socket.
        docker_allowed_images: patterns of the images docker jobs may name, matched against
            the normalized reference (``docker.io/library/hora:cpu``; patterns are normalized
            alike, so ``hora:*`` means the images named ``hora`` only); ``*`` and ``?`` never
            cross a ``/``; ``sha256:<id>`` allows one image by its ID. Anything else is
            refused at submission (see :mod:`hora_service.runtimes.imageref`).
        docker_pull: ``if-not-present`` (pull an image the engine lacks) or ``never``.
        docker_shm_size: size of a job container's ``/dev/shm`` (NCCL and DataLoader
            workers use it), e.g. ``4g``.
        docker_ipc: the containers' IPC mode: ``private``, ``shareable`` or ``host``.
        docker_network: the network mode of session containers, and of job containers
            when ``job_private_network`` is off (``host``: ranks and rendezvous use the
            host's network); job containers otherwise get ``none`` (a loopback of their own).
        docker_ulimits: ``NAME=SOFT[:HARD]`` limits set in the containers (``memlock=-1``);
            raising one may be refused by the engine.
        docker_devices: extra host devices given to the containers (``/dev/infiniband``).
        docker_uid: the account docker jobs run as when the job has none of its own (single
            and shared modes): never root.
        store_write_timeout_s: how long a request that writes (a submit) waits for the
            store's write lock before it answers 503 with ``Retry-After``.
        health_interval_s: seconds between two background checks of the store behind
            ``/healthz``.
        max_spec_bytes: largest job spec (its JSON) one submit may store (413 past it).
        max_page_bytes: a page of ``GET /v1/jobs`` stops before this many bytes; its
            ``next_offset`` says where the next page starts.
        max_running_jobs_per_user: most jobs of one user starting or running at once (the
            rest wait in the queue); None: no limit.
        max_queued_jobs_per_user: most jobs of one user waiting in the queue (a submit past
            it answers 429); None: no limit.
        max_log_streams_per_user: most log streams (``follow=true``) one user keeps open at
            once (429 past it).
        session_lease_s: a session whose kernel sent no heartbeat for this long is ended and
            its slots freed (a kernel killed with -9).
        session_idle_timeout_s: a running session whose engines ran nothing for this long is
            stopped (None: never); a session may ask for another value, and a user may have
            their own (``hora user set NAME --idle-timeout S``).
        session_idle_timeout_max_s: the longest idle timeout a session may ask for, and the
            cap of a user's and of the default (None: any).
        session_idle_warn_s: how long before the idle timeout the notebook is warned.
        session_busy_cpu: share of a core per engine above which the service counts a
            session's engines as computing (their CPU time is sampled every 2 s); below it
            they are idle, whatever the kernel's heartbeats say.
        session_idle_action: what the idle timeout does to a session: ``park`` (its engines'
            state is saved in the owner's own directory, the slots are freed, and the next
            ``%%distributed`` cell resumes it) or ``stop`` (the engines and their variables
            are gone). A session whose park fails (over the quota) is stopped.
        session_park_quota: most bytes of parked snapshots one user may keep (a size such as
            ``50g``, or ``none``); a park past it is refused and its engines keep running.
        session_park_retention_s: a parked session not resumed within this long is ended
            and its snapshot deleted.
        session_preempt_idle_s: a job or session of a higher priority that waits for slots
            parks a running session of a lower priority whose engines have been idle this
            long (a running cell is never interrupted); None: never.
        session_python: the Python that runs local sessions' engines (``python -m
            hora.engines._child session-engine``) and elastic jobs' drivers (``python -m
            hora.launch``); it needs hora, ipyparallel and torch. By default the service's
            own, which in multi-user mode the job accounts must be able to execute (a
            virtualenv under ``/root`` is not).
        job_umask: the file mode creation mask of every rank (octal; ``077``: files a job
            creates are its account's alone).
        job_memory_limit: most memory one attempt's processes hold together: ``auto`` (the
            attempt's share of 90 % of the machine's memory: the slots it holds over all
            slots), ``none``, or a size (``8g``, ``512m``); past it the kernel's OOM killer
            ends a process and the job's reason names the limit. A user may have their own
            (``hora user set NAME --memory 16g``). See :mod:`hora_service.runtimes.limits`.
        job_pids_limit: most processes and threads of one attempt at once: ``auto`` (its
            share of half the machine's process table, 1024 to 65536), ``none`` or a count.
        user_disk_limit: in multi-user mode, the size of each user's working directory
            ``WORK_ROOT/<user>``, made as a loop-mounted file system of that size when the
            directory is made (``none``: no limit, the default; see
            :mod:`hora_service.users.disks`). A job that fills it gets ``ENOSPC``.
        job_disk_limit: most bytes each of a job's private ``/tmp``, ``/var/tmp`` and
            ``/dev/shm`` holds (tmpfs, counted against the job's memory too), where the job
            has its own (multi-user mode with ``job_private_network``; the docker runtime's
            ``/tmp`` and ``/var/tmp``); ``none`` (the default): the kernel's tmpfs default,
            half the machine's memory each. A job past it gets ``ENOSPC``. Its working
            directory is limited per user (``user_disk_limit``); see the operations page.
        job_cpu_limit: a hard cap on the CPUs' worth of time one attempt uses: ``none``
            (the default: attempts share the CPUs in proportion to their slots, and use an
            idle machine whole), ``auto`` (its share of the machine's CPUs, at least one) or
            a number (``2``, ``0.5``).
        slurm_conf: the ``slurm.conf`` Slurm's commands read (None: ``SLURM_CONF`` of the
            service's environment, else Slurm's default).
        slurm_bin_dir: where ``sbatch``, ``srun``, ``squeue``, ``scancel`` live (None: the
            service's ``PATH``).
        slurm_slots_per_node: GPUs (``slurm_gpus``) or ranks one node of the partition
            gives a slurm job; a job spans ``ceil(workers * gpus_per_worker / this)`` nodes.
            None (the default): what Slurm reports of the partition's smallest node, its
            GPUs (``Gres``), or its CPUs without ``slurm_gpus``.
        slurm_gpus: ask Slurm for GPUs (``--gres=gpu:G``); False on CPU-only partitions.
        slurm_partition: ``--partition`` of every slurm job (None: the cluster's default).
        slurm_account: ``--account`` of every slurm job.
        slurm_qos: ``--qos`` of every slurm job.
        slurm_high_priority_qos: ``--qos`` of ``priority: high`` jobs (None: ``slurm_qos``).
        slurm_low_priority_nice: ``--nice`` of ``priority: low`` jobs.
        slurm_signal_s: USR2 reaches the ranks this many seconds before Slurm's time limit,
            and at preemption (``--signal=B:USR2@N``; never USR1, which NCCL catches).
        slurm_default_time_min: ``--time`` of a job without ``timeout_s`` (None: the
            partition's default).
        slurm_session_address: the address of this machine the Slurm nodes reach it at,
            where a notebook's controller listens for the engines of a ``slurm`` session
            (None: the address this machine reaches the first node from).
        job_preflight: ask every job's ranks for a communication preflight at
            ``hora.torch.init()`` (``HORA_PREFLIGHT=1``; a job's ``env`` may set it to 0).
        job_preflight_fail_below: fail a job whose rank, link or path measures under this
            fraction of its reference, and a session's ``%dist_start`` (None: only name it).
        job_preflight_baseline_dir: the nodes' recorded preflight baselines (``<host>.json``).
        hub: run as a JupyterHub service (``hora serve --hub``): the API and the dashboard
            also accept the hub's users, signed in through the hub's OAuth, each mapped to
            the hora user of the same name, created on first contact and bound to the OS
            account of that name (multi-user mode). See :mod:`hora_service.hub`.
        hub_api_url: the hub's REST API as the service reaches it (else
            ``JUPYTERHUB_API_URL``, which the hub sets for a service it starts).
        hub_api_token: the service's ``api_token`` in the hub's configuration (else
            ``JUPYTERHUB_API_TOKEN``); it is also the OAuth client's secret.
        hub_service_name: the service's name in the hub's configuration (else
            ``JUPYTERHUB_SERVICE_NAME``); users need ``access:services!service=NAME``.
        hub_client_id: the service's OAuth client id (else ``JUPYTERHUB_CLIENT_ID``;
            default ``service-NAME``).
        hub_service_prefix: the path the hub's proxy serves the service at (else
            ``JUPYTERHUB_SERVICE_PREFIX``; default ``/services/NAME/``).
        hub_base_url: the hub's base URL path (else ``JUPYTERHUB_BASE_URL``): the browser
            is sent to ``BASE/hub/api/oauth2/authorize`` to sign in.
        hub_oauth_callback_url: the OAuth redirect URI the hub has for the service (else
            ``JUPYTERHUB_OAUTH_CALLBACK_URL``; default ``PREFIX/oauth_callback``).
        hub_admins: the hub's admins are hora admins too (by default they are not: a hora
            admin is made with ``hora user add NAME --admin``).
        hub_cache_s: how long the service trusts the hub's answer about a token before it
            asks again (a token the hub revoked, at logout or when the user's server
            stopped, stops working within this time).
        lease_dir: the machine's lease directory, shared by every hora on this machine (one
            lock file per GPU and CPU slot, see :mod:`hora.leases`); None: the machine's
            default (``/run/lock/hora-leases``, else ``/tmp/hora-leases``). Kernel-local
            engines read the same ``HORA_LEASE_DIR``.
    """

    model_config = SettingsConfigDict(env_prefix="HORA_", extra="ignore", populate_by_name=True)

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    data_dir: Path = Path("~/.hora")
    gpus: str = "auto"
    cpu_slots: Annotated[int, Field(ge=1, le=4096)] = 2
    work_root: Path = Path("~")
    user_gpu_quota: Annotated[int | None, Field(ge=1)] = None
    kill_grace_s: Annotated[float, Field(ge=0, le=3600)] = 10.0
    retry_backoff_s: Annotated[float, Field(ge=0, le=3600)] = 2.0
    monitor_interval_s: Annotated[float, Field(gt=0, le=60)] = 0.5
    dev_mode: bool = False
    max_request_bytes: int = 1 << 20
    max_log_request_bytes: Annotated[int, Field(ge=1)] = 1 << 20
    user_mode: Literal["auto", "multi", "single", "shared"] = "auto"
    containment: Literal["auto", "cgroup2", "cgroup1", "tag"] = "auto"
    job_private_network: bool = True
    job_tmp_paths: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    job_env_passthrough: Annotated[list[str], NoDecode] = Field(default_factory=list)
    log_bytes_per_attempt: Annotated[int, Field(ge=1 << 16)] = 256 << 20
    clear_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    elastic_shrink_timeout_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 120.0
    docker_host: str | None = None
    docker_allowed_images: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["hora:*", "hora-*:*"]
    )
    docker_pull: Literal["if-not-present", "never"] = "if-not-present"
    docker_shm_size: str = "4g"
    docker_ipc: Literal["private", "shareable", "host"] = "private"
    docker_network: str = "host"
    docker_ulimits: Annotated[list[str], NoDecode] = Field(default_factory=list)
    docker_devices: Annotated[list[str], NoDecode] = Field(default_factory=list)
    docker_uid: Annotated[int, Field(ge=1)] = 65534
    store_write_timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    health_interval_s: Annotated[float, Field(gt=0, le=600)] = 2.0
    max_spec_bytes: Annotated[int, Field(ge=1024)] = 64 << 10
    max_page_bytes: Annotated[int, Field(ge=1024)] = 4 << 20
    max_running_jobs_per_user: Annotated[int | None, Field(ge=1)] = 64
    max_queued_jobs_per_user: Annotated[int | None, Field(ge=1)] = 10_000
    max_log_streams_per_user: Annotated[int, Field(ge=1)] = 16
    session_lease_s: Annotated[float, Field(gt=0, le=24 * 3600)] = 30.0
    session_idle_timeout_s: Annotated[float | None, Field(gt=0)] = 3600.0
    session_idle_timeout_max_s: Annotated[float | None, Field(gt=0)] = None
    session_idle_warn_s: Annotated[float, Field(ge=0)] = 300.0
    session_busy_cpu: Annotated[float, Field(gt=0, le=64)] = 0.1
    session_idle_action: Literal["park", "stop"] = "park"
    session_park_quota: str = "none"
    session_park_retention_s: Annotated[float, Field(gt=0)] = 7 * 24 * 3600.0
    session_preempt_idle_s: Annotated[float | None, Field(ge=0)] = 300.0
    session_python: Path | None = None
    job_umask: str = "077"
    job_memory_limit: str = "auto"
    job_pids_limit: str = "auto"
    job_cpu_limit: str = "none"
    user_disk_limit: str = "none"
    job_disk_limit: str = "none"
    slurm_conf: Path | None = None
    slurm_bin_dir: Path | None = None
    slurm_slots_per_node: Annotated[int | None, Field(ge=1, le=1024)] = None
    slurm_gpus: bool = True
    slurm_partition: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9_.,-]+$")] = None
    slurm_account: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9_.-]+$")] = None
    slurm_qos: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9_.-]+$")] = None
    slurm_high_priority_qos: Annotated[str | None, Field(pattern=r"^[A-Za-z0-9_.-]+$")] = None
    slurm_low_priority_nice: Annotated[int, Field(ge=0, le=2**31 - 1)] = 100
    slurm_signal_s: Annotated[int, Field(ge=1, le=65535)] = 60
    slurm_default_time_min: Annotated[int | None, Field(ge=1)] = None
    slurm_session_address: Annotated[
        str | None, Field(pattern=r"^[0-9]{1,3}(\.[0-9]{1,3}){3}$")
    ] = None
    job_preflight: bool = True
    job_preflight_fail_below: Annotated[float | None, Field(gt=0, le=1)] = None
    job_preflight_baseline_dir: Path | None = None
    hub: bool = False
    hub_api_url: Annotated[str, _hub("api_url")] = "http://127.0.0.1:8081/hub/api"
    hub_api_token: Annotated[SecretStr | None, _hub("api_token")] = None
    hub_service_name: Annotated[str, _hub("service_name"), Field(pattern=r"^[\w.-]+$")] = "hora"
    hub_client_id: Annotated[str | None, _hub("client_id")] = None
    hub_service_prefix: Annotated[str | None, _hub("service_prefix")] = None
    hub_base_url: Annotated[str, _hub("base_url")] = "/"
    hub_oauth_callback_url: Annotated[str | None, _hub("oauth_callback_url")] = None
    hub_admins: bool = False
    hub_cache_s: Annotated[float, Field(ge=0, le=3600)] = 30.0
    lease_dir: Path | None = None

    @field_validator("data_dir", "work_root")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @field_validator("job_tmp_paths")
    @classmethod
    def _absolute_all(cls, v: list[Path]) -> list[Path]:
        return [p.expanduser().resolve() for p in v]

    @field_validator(
        "job_env_passthrough", "docker_allowed_images", "docker_ulimits", "docker_devices",
        "job_tmp_paths", mode="before",
    )
    @classmethod
    def _names(cls, v: object) -> object:
        return [n.strip() for n in v.split(",") if n.strip()] if isinstance(v, str) else v

    @field_validator("job_umask")
    @classmethod
    def _umask(cls, v: str) -> str:
        try:
            mask = int(v.strip(), 8)
        except ValueError:
            mask = -1
        if not 0 <= mask <= 0o777:
            raise ValueError(f"job_umask must be an octal mask like 077; got {v!r}")
        return f"{mask:03o}"

    @field_validator(
        "job_memory_limit", "job_pids_limit", "job_cpu_limit", "user_disk_limit", "job_disk_limit"
    )
    @classmethod
    def _limit(cls, v: str, info: ValidationInfo) -> str:
        kind = {"job_pids_limit": "pids", "job_cpu_limit": "cpus"}.get(
            str(info.field_name), "memory"
        )
        if limits.parse(kind, v) == "auto" and "disk" in str(info.field_name):
            raise ValueError(f"{info.field_name} is a size or none (there is no auto)")
        return v.strip().lower()

    @field_validator("session_park_quota")
    @classmethod
    def _park_quota(cls, v: str) -> str:
        if limits.parse("memory", v) == "auto":
            raise ValueError("session_park_quota is a size or none (there is no auto)")
        return v.strip().lower()

    @property
    def park_quota_bytes(self) -> int | None:
        """``session_park_quota`` in bytes (None: no quota)."""
        size = limits.parse("memory", self.session_park_quota)
        return size if isinstance(size, int) else None

    @property
    def disk_bytes(self) -> int | None:
        """``user_disk_limit`` in bytes (None: no limit)."""
        size = limits.parse("memory", self.user_disk_limit)
        return size if isinstance(size, int) else None

    @property
    def job_tmp_bytes(self) -> int | None:
        """``job_disk_limit`` in bytes (None: no limit of hora's)."""
        size = limits.parse("memory", self.job_disk_limit)
        return size if isinstance(size, int) else None

    @property
    def limit_values(self) -> dict[str, str]:
        """The service's job limits as written, by kind (``memory``, ``pids``, ``cpus``)."""
        return {
            "memory": self.job_memory_limit,
            "pids": self.job_pids_limit,
            "cpus": self.job_cpu_limit,
        }

    @field_validator("docker_allowed_images")
    @classmethod
    def _patterns(cls, v: list[str]) -> list[str]:
        return [check_pattern(p) for p in v]

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: str) -> str:
        v = v.strip()
        if v == "auto" or v.isdigit():
            return v
        parts = [p.strip() for p in v.split(",")]
        if not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(f"gpus must be auto, a count or a list like 0,1,3; got {v!r}")
        return ",".join(parts)

    @property
    def hub_prefix(self) -> str:
        """The path the hub's proxy serves the service at, ``/services/NAME/`` by default."""
        prefix = self.hub_service_prefix or f"/services/{self.hub_service_name}/"
        return "/" + prefix.strip("/") + "/"

    @property
    def hub_client(self) -> str:
        """The service's OAuth client id at the hub."""
        return self.hub_client_id or f"service-{self.hub_service_name}"

    @property
    def hub_callback(self) -> str:
        """The OAuth redirect URI registered for the service."""
        return self.hub_oauth_callback_url or f"{self.hub_prefix}oauth_callback"

    @property
    def url(self) -> str:
        """Where clients on this machine reach the service (named in its leases)."""
        return service_url(self.host, self.port)

    @property
    def db_path(self) -> Path:
        """The SQLite database file."""
        return self.data_dir / "hora.db"

    @property
    def logs_dir(self) -> Path:
        """Root of every job's logs and run files (``logs/<job>/<attempt>/``)."""
        return self.data_dir / "logs"
