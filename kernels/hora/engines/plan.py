"""Pure functions that decide what the engine processes look like (data plane).

Everything that becomes a process is built here without side effects, so it can be tested
line by line: which GPU each rank gets (:func:`plan_devices`), each engine's environment
(:func:`engine_env`: ``CUDA_VISIBLE_DEVICES`` of every engine's GPU, set before CUDA can
initialise in it, each engine pinning its own as ``cuda:LOCAL_RANK``, plus the
rank environment of :func:`hora.env.rank_env`, layered by :func:`hora.env.layered_env`), and
the argument lists of the controller and engine processes. The notebook kernel's own
``os.environ`` is only ever read, never changed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hora.engines.errors import CudaInitializedError, NotEnoughGpusError
from hora.env import LAUNCHER_VARS, RankEnv, layered_env, rank_env
from hora.errors import SpecError
from hora.inventory import GpuInfo

# GpuInfo's home before the one inventory module (users import it here); the GPU listing
# parser is hora.inventory.parse_gpu_apps (hora.inventory.parse_nvidia_smi lists slots)
__all__ = ["GpuInfo"]

DEFAULT_CPU_ENGINES = 2
DEFAULT_TIMEOUT_S = 60.0
CLUSTER_ID = "hora"
HEARTBEAT_MS = 250
HEARTBEAT_MISSES = 40
INLINE_MPL = "module://matplotlib_inline.backend_inline"
# What an engine must not inherit from the notebook kernel: a launcher's world
# (hora.env.LAUNCHER_VARS), the kernel's own GPU, and Jupyter's and ipyparallel's ties to the
# kernel's parent and controller.
_STRIP = frozenset(LAUNCHER_VARS) | {
    "HORA_GPU",
    "JPY_PARENT_PID",
    "IPP_CONNECTION_INFO",
    "IPP_ENABLE_CURVE",
    "IPP_CURVE_PUBLICKEY",
    "IPP_CURVE_SECRETKEY",
}


@dataclass(frozen=True)
class ClusterOptions:
    """How to start the engines (what ``%dist_start`` parsed; reused by ``%dist_restart``).

    Attributes:
        n: number of engines (ranks); None means one per free GPU, else 2 on CPU.
        gpus: GPU ids to bind, one per rank (``CUDA_VISIBLE_DEVICES`` entries); None: choose.
        backend: "nccl" or "gloo"; None: nccl with GPUs, gloo on CPU.
        timeout_s: collective timeout in the engines; half of it is a cell's default stall
            timeout (:attr:`stall_timeout_s`).
        start_timeout_s: how long engines may take to register and initialise.
        threads: torch threads per engine on CPU (OMP_NUM_THREADS) when the kernel sets none.
    """

    n: int | None = None
    gpus: tuple[str, ...] | None = None
    backend: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    start_timeout_s: float = 60.0
    threads: int = 1

    @property
    def stall_timeout_s(self) -> float:
        """A cell's default stall timeout: half the collective timeout.

        A rank left waiting in a collective that the others never entered is reported as a
        stall (which rank, its stack) this long after the first rank finished, before the
        collective's own timeout ends the cell with a bare backend error.

        Example:
            >>> ClusterOptions(timeout_s=60).stall_timeout_s
            30.0
        """
        return self.timeout_s / 2

    def __post_init__(self) -> None:
        if self.n is not None and self.n < 1:
            raise SpecError("n", f"number of engines must be >= 1, got {self.n}")
        if self.backend is not None and self.backend not in ("nccl", "gloo"):
            raise SpecError("backend", f"must be nccl or gloo, got {self.backend!r}")
        if self.timeout_s <= 0:
            raise SpecError("timeout", f"must be > 0 seconds, got {self.timeout_s:g}")
        if self.start_timeout_s <= 0:
            raise SpecError("start_timeout", f"must be > 0 seconds, got {self.start_timeout_s:g}")
        if self.gpus is not None and self.n is not None and len(self.gpus) != self.n:
            raise SpecError("gpus", f"{len(self.gpus)} GPUs listed for {self.n} engines")


def check_cuda_free(is_initialized: Callable[[], bool]) -> None:
    """Refuse to start engines when CUDA is already initialised in the notebook kernel.

    Args:
        is_initialized: returns whether the kernel holds a CUDA context (in the kernel:
            ``torch.cuda.is_initialized`` if torch is imported; tests inject a fake).

    Raises:
        CudaInitializedError: with what to do about it.

    Example:
        >>> check_cuda_free(lambda: False)
    """
    if is_initialized():
        raise CudaInitializedError(
            "CUDA is already initialised in this notebook kernel, so the GPUs cannot be given to "
            "the engines; restart the kernel and run %dist_start before using CUDA in the notebook"
        )


def plan_devices(
    n: int | None, gpus: Sequence[str] | None, visible: Sequence[GpuInfo]
) -> list[str | None]:
    """Choose one device per rank: a GPU id, or None for a CPU engine.

    Args:
        n: engines asked for (None: one per free GPU, else 2 on CPU).
        gpus: GPU ids asked for explicitly (``--gpus``), or None.
        visible: the GPUs the kernel can see.

    Returns:
        ``devices[rank]``: the GPU id bound to that rank, or None on CPU.

    Raises:
        NotEnoughGpusError: when more GPUs are asked for than are visible and free.

    Example:
        >>> plan_devices(2, None, [])
        [None, None]
    """
    ids = [g.id for g in visible]
    free = [g.id for g in visible if not g.busy_pids and g.holder is None]
    if gpus is not None:
        unknown = [g for g in gpus if g not in ids]
        taken = [g for g in gpus if g in ids and g not in free]
        if unknown or taken or len(set(gpus)) != len(gpus):
            why = (
                f"GPU {', '.join(unknown)} not visible"
                if unknown
                else _busy(visible, taken)
                if taken
                else "a GPU is listed twice"
            )
            raise NotEnoughGpusError(len(gpus), ids, free, f"{why}; pick from the free ones")
        return list(gpus)
    if not visible:
        return [None] * (n if n is not None else DEFAULT_CPU_ENGINES)
    want = len(free) if n is None else n
    if want == 0 or want > len(free):
        busy = _busy(visible, ids)
        hint = f"pass -n {len(free)}" if free else "free a GPU"
        raise NotEnoughGpusError(want or 1, ids, free, hint + (f" ({busy})" if busy else ""))
    return list(free[:want])


def _busy(visible: Sequence[GpuInfo], which: Sequence[str]) -> str:
    """Who uses the GPUs of ``which``: the pids with a CUDA context, the lease's holder.

    Example:
        >>> _busy([GpuInfo("0", (7,)), GpuInfo("1", holder="pid 9")], ["0", "1"])
        'GPU 0 used by pid 7; GPU 1 held by pid 9'
    """
    out = []
    for g in visible:
        if g.id in which and g.busy_pids:
            out.append(f"GPU {g.id} used by pid {', '.join(map(str, g.busy_pids))}")
        if g.id in which and g.holder is not None:
            out.append(f"GPU {g.id} held by {g.holder}")
    return "; ".join(out)


def engine_env(
    base: Mapping[str, str],
    *,
    rank: int,
    size: int,
    device: str | None,
    master_port: int,
    backend: str,
    timeout_s: float,
    threads: int = 1,
    gpus: Sequence[str] = (),
    rdzv_secret: str = "",
) -> dict[str, str]:
    """Build one engine's environment from the kernel's (which is left untouched).

    Args:
        base: the kernel's environment (``os.environ``), copied.
        rank: the engine's rank.
        size: number of engines.
        device: this engine's GPU id (``HORA_GPU``), or None for a CPU engine.
        master_port: rendezvous port of the process group.
        backend: "nccl" or "gloo" (``HORA_BACKEND``).
        timeout_s: collective timeout (``HORA_TIMEOUT``).
        threads: OMP_NUM_THREADS for CPU engines when ``base`` sets none.
        gpus: the GPU ids of every engine, by rank (default: ``device`` alone).
        rdzv_secret: the engines' rendezvous secret (``HORA_RDZV_SECRET``), the same for
            every engine of one cluster; empty: none (the store is not sealed).

    Returns:
        A new dict: the launcher variables are replaced by this rank's.

    Example:
        >>> env = engine_env({}, rank=1, size=2, device="3", master_port=1234, backend="nccl",
        ...                  timeout_s=60, gpus=["1", "3"])
        >>> env["CUDA_VISIBLE_DEVICES"], env["HORA_GPU"], env["RANK"], env["LOCAL_RANK"]
        ('1,3', '3', '1', '1')
    """
    # Every engine sees all the engines' GPUs and is local rank r of this host, so that
    # hora.torch (and Horovod code doing torch.cuda.set_device(hvd.local_rank())) picks
    # cuda:r, its own; NCCL's CUDA IPC / NVLink paths need GPUs the ranks share.
    own = RankEnv(backend=backend, timeout=timeout_s, rdzv_secret=rdzv_secret or None, gpu=device)
    placed = (
        {"CUDA_VISIBLE_DEVICES": ",".join(gpus) if gpus else device}
        if device is not None
        else {"OMP_NUM_THREADS": str(threads)}  # a default: the kernel's own stays
    )
    hora = {
        **rank_env(rank, size, master_port=master_port), **own.to_environ(),
        "PYTHONUNBUFFERED": "1", "MPLBACKEND": INLINE_MPL, **placed,
    }  # fmt: skip
    return layered_env(base, strip=_STRIP, rank=hora, defaults=("OMP_NUM_THREADS",))


ENGINE_CHANNELS = ("control", "mux", "task", "iopub", "hb_ping", "hb_pong")
CLIENT_CHANNELS = ("control", "mux", "task", "iopub", "notification", "broadcast")
LEAF_SCHEDULERS = 2  # ipyparallel's broadcast tree of depth 1 has two leaves
CONNECTION_PORTS = 1 + len(ENGINE_CHANNELS) + LEAF_SCHEDULERS + len(CLIENT_CHANNELS)
# the controller's own links on the loopback: the broadcast tree's two inner nodes, the monitor
INTERNAL_PORTS = LEAF_SCHEDULERS + 1


def connection_files(
    ports: Sequence[int],
    key: str,
    location: str,
    ip: str = "127.0.0.1",
    curve_serverkey: str | None = None,
) -> tuple[dict[str, object], dict[str, object]]:
    """The controller's engine and client connection files, chosen before it starts.

    The controller started with ``--reuse`` binds what they say, so engines started elsewhere
    (by the hora service) can be told where to connect while the controller is still starting.

    Args:
        ports: :data:`CONNECTION_PORTS` distinct free ports on ``ip``.
        key: the session key that signs messages.
        location: this host's name.
        ip: where the controller listens: the loopback, or an address other machines reach
            (engines on Slurm nodes).
        curve_serverkey: the controller's CurveZMQ public key (:func:`curve_keys`); start
            the controller with :func:`controller_env` of the same pair. None: no CurveZMQ.

    Returns:
        ``(engine, client)`` as ipyparallel writes them to ``ipcontroller-*-{engine,client}.json``.

    Example:
        >>> engine, client = connection_files(range(1, 16), "k", "vm")
        >>> engine["registration"] == client["registration"], engine["broadcast"]
        (True, [8, 9])
    """
    if len(set(ports)) != CONNECTION_PORTS:
        raise SpecError("ports", f"need {CONNECTION_PORTS} distinct ports, got {list(ports)}")
    it = iter(ports)
    common = {"ssh": "", "interface": f"tcp://{ip}", "registration": next(it)}
    tail = {
        "key": key, "curve_serverkey": curve_serverkey, "location": location, "pack": "json",
        "unpack": "json", "signature_scheme": "hmac-sha256",
    }  # fmt: skip
    engine: dict[str, object] = {**common, **{c: next(it) for c in ENGINE_CHANNELS}}
    engine["broadcast"] = [next(it) for _ in range(LEAF_SCHEDULERS)]
    client: dict[str, object] = {**common, **{c: next(it) for c in CLIENT_CHANNELS}}
    client["task_scheme"] = "leastload"
    return {**engine, **tail}, {**client, **tail}


def curve_keys() -> tuple[str, str]:
    """A fresh CurveZMQ key pair for a controller: ``(public, secret)``, Z85 text.

    The controller's sockets then accept only peers that know its public key, which hora
    writes only into the cluster's private connection files (and a session's request):
    whoever merely reaches its ports on the host's loopback (another user's engines share
    it) can neither read what it publishes nor register nor send to it.
    """
    import zmq  # ipyparallel's own dependency; imported here to keep this module light

    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


def controller_env(base: Mapping[str, str], keys: tuple[str, str] | None = None) -> dict[str, str]:
    """The controller's environment: ``base`` with CurveZMQ turned on.

    Args:
        base: the kernel's environment, copied.
        keys: ``(public, secret)`` from :func:`curve_keys`, for a controller started on
            connection files hora wrote (``--reuse``); None: the controller makes its own
            pair and writes the public key into the connection files it writes.

    Example:
        >>> controller_env({}, ("pub", "sec"))["IPP_ENABLE_CURVE"]
        '1'
    """
    env = {k: v for k, v in base.items() if not k.startswith("IPP_CURVE_")}
    env["IPP_ENABLE_CURVE"] = "1"
    if keys is not None:
        env["IPP_CURVE_PUBLICKEY"], env["IPP_CURVE_SECRETKEY"] = keys
    return env


def controller_argv(
    profile_dir: Path,
    python: str = sys.executable,
    reuse: bool = False,
    ip: str = "127.0.0.1",
    ports: Sequence[int] = (),
) -> list[str]:
    """Return the controller's command line (schedulers in threads, fast heartbeat, on ``ip``).

    With ``reuse`` it binds the connection files already in ``profile_dir``. ``ip`` is the
    loopback unless engines on other machines (Slurm nodes) must reach it. ``ports`` are the
    ports it binds for what the files do not name, in its own order (all of them without
    ``reuse``: :data:`CONNECTION_PORTS` + :data:`INTERNAL_PORTS`; the internal ones with it).
    Left to itself, ipyparallel asks the OS for a free port, closes it, and binds it later
    (its heart monitor, in a process it forks, a second or more later): meanwhile any
    outgoing connection on the machine may take that port as its source, and a heart monitor
    that cannot bind leaves engines that register but never hear a heartbeat.
    Ports from :func:`hora.net.free_port` lie below the OS's ephemeral range, where no
    outgoing connection takes its port.

    Example:
        >>> controller_argv(Path("/p"), ports=[20001, 20002])[-1]
        '--IPController.ports=20001,20002'
    """
    return [
        python,
        "-m",
        "hora.engines._child",
        "controller",
        "--usethreads",
        f"--ip={ip}",
        f"--profile-dir={profile_dir}",
        f"--cluster-id={CLUSTER_ID}",
        "--log-level=WARN",
        f"--HeartMonitor.period={HEARTBEAT_MS}",
        f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
        *(["--reuse"] if reuse else []),
        *([f"--IPController.ports={','.join(map(str, ports))}"] if ports else []),
    ]


def engine_argv(profile_dir: Path, stack_file: Path, python: str = sys.executable) -> list[str]:
    """Return one engine's command line (no nanny: hora signals engines by pid itself)."""
    url = profile_dir / "security" / f"ipcontroller-{CLUSTER_ID}-engine.json"
    return [
        python,
        "-m",
        "hora.engines._child",
        "engine",
        f"--stack-file={stack_file}",
        f"--profile-dir={profile_dir}",
        f"--cluster-id={CLUSTER_ID}",
        "--log-level=WARN",
        f"--IPEngine.url_file={url}",
        "--IPEngine.enable_nanny=False",
        "--IPEngine.wait_for_url_file=60",
    ]


def client_file(profile_dir: Path) -> Path:
    """Return where the controller writes the client connection file."""
    return profile_dir / "security" / f"ipcontroller-{CLUSTER_ID}-client.json"
