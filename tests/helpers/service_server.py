"""A real `hora serve` (uvicorn) on 127.0.0.1 at a free port, for e2e tests of the service.

    with ServiceServer(tmp_path, users={"ann": False, "root": True}) as srv:
        httpx.get(srv.url + "/v1/jobs", headers=srv.auth("ann"))

The data dir is a temp dir (a real SQLite file); users are created with the real store
before the server starts. On exit every job still active is cancelled through the API, the
server gets SIGTERM (SIGKILL after a grace period), and the helper checks that the server and
every process it started (job ranks included) are gone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from hora import net

from helpers.http_tls import tls

# the service's app under uvicorn; on the listening socket that ServiceServer bound and passed
# (LISTEN_FD), else on HORA_HOST:HORA_PORT
LISTEN_FD = "HORA_TEST_LISTEN_FD"
SERVE = (
    "import os, socket, uvicorn;"
    "from hora_service.settings import Settings;"
    "from hora_service.api.app import create_app;"
    f"fd = os.environ.pop({LISTEN_FD!r}, '');"
    "s = Settings();"
    "app = create_app(s);"
    "uvicorn.Server(uvicorn.Config(app, log_level='warning')).run("
    "sockets=[socket.socket(fileno=int(fd))]) if fd else "
    "uvicorn.run(app, host=s.host, port=s.port, log_level='warning')"
)
ACTIVE = ("queued", "starting", "running", "retrying")

# job scripts: plain python (fast to start) except ddp.py (2 ranks on torch gloo)
SCRIPTS = {
    "hello.py": (
        "import os\n"
        "r, n = os.environ['RANK'], os.environ['WORLD_SIZE']\n"
        "print(f'hello from rank {r} of {n} attempt {os.environ.get(\"HORA_RESTART_COUNT\")}')\n"
    ),
    "chatty.py": (
        "import sys, time\n"
        "n, delay = int(sys.argv[1]), float(sys.argv[2])\n"
        "for i in range(n):\n"
        "    print(f'line {i:04d} ' + 'x' * 40, flush=True)\n"
        "    time.sleep(delay)\n"
        "print('done', flush=True)\n"
    ),
    "sleeper.py": (
        "import os, pathlib, sys, time\n"
        "d = pathlib.Path(sys.argv[1]); d.mkdir(parents=True, exist_ok=True)\n"
        "(d / os.environ['RANK']).write_text(str(os.getpid()))\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    ),
    "fail.py": (
        "import os, sys\n"
        "print('rank', os.environ['RANK'], 'here', flush=True)\n"
        "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n"
    ),
    "flaky.py": (
        "import os, sys\n"
        "n = os.environ.get('HORA_RESTART_COUNT', '0')\n"
        "print(f'attempt with restart count {n}', flush=True)\n"
        "sys.exit(1 if n == '0' else 0)\n"
    ),
    "ddp.py": (
        "import os, torch, torch.distributed as dist\n"
        "torch.set_num_threads(1)\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "print(f'rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g}', flush=True)\n"
        "dist.destroy_process_group()\n"
    ),
}


def write_scripts(where: Path) -> dict[str, Path]:
    where.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, text in SCRIPTS.items():
        (where / name).write_text(text)
        out[name.removesuffix(".py")] = where / name
    return out


def free_port() -> int:
    """A free port below the ephemeral range (hora.net.free_port): no outgoing connection of
    another process takes it before the server binds it."""
    return net.free_port()


def make_users(
    data_dir: Path,
    users: dict[str, bool],
    accounts: dict[str, int] | None = None,
    work_root: Path | None = None,
) -> dict[str, str]:
    """Create users in the store of data_dir; return name -> token.

    With ``accounts`` (name -> uid), the store is set up for multi-user mode and each user's
    jobs run as that uid (their working directories are made under ``work_root``, default
    ``data_dir``'s parent, as the server's).
    """
    from hora_service.manager import JobManager
    from hora_service.settings import Settings

    mode = "multi" if accounts else os.environ.get("HORA_USER_MODE", "shared")
    root = work_root or data_dir.parent
    manager = JobManager(Settings(data_dir=data_dir, user_mode=mode, work_root=root))
    tokens = {}
    open_users = getattr(manager, "open_store", None)
    if open_users is not None:
        open_users()
    for name, admin in users.items():
        uid = (accounts or {}).get(name)
        tokens[name] = str(manager.users.create(name, admin=admin, uid=uid))
    close = getattr(manager, "close_store", None)
    if close is not None:
        close()
    return tokens


REPO = Path(__file__).resolve().parents[2]


def server_env(
    data_dir: Path,
    port: int,
    cpu_slots: int = 4,
    extra: dict[str, str] | None = None,
    work_root: Path | None = None,
) -> dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("HORA_") and k != "HORA_LEASE_DIR":  # the test's own (tests/conftest.py)
            env.pop(k)
    env.update(
        {
            "HORA_DATA_DIR": str(data_dir),
            "HORA_WORK_ROOT": str(work_root or data_dir.parent),
            "HORA_HOST": "127.0.0.1",
            "HORA_PORT": str(port),
            "HORA_GPUS": "0",
            "HORA_CPU_SLOTS": str(cpu_slots),
            "HORA_KILL_GRACE_S": "3",
            "HORA_RETRY_BACKOFF_S": "0.2",
            "HORA_MONITOR_INTERVAL_S": "0.1",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "HORA_USER_MODE": os.environ.get("HORA_USER_MODE", "shared"),
            # jobs get a clean environment; these let them import this checkout's code
            "HORA_JOB_ENV_PASSTHROUGH": "PYTHONPATH,OMP_NUM_THREADS,PYTHONUNBUFFERED",
            # ... and see it where a checkout (CI's clone, say) lies under /tmp, which a job
            # with a private /tmp (multi-user mode) would not see otherwise
            "HORA_JOB_TMP_PATHS": f"{REPO},{sys.prefix}",
        }
    )
    env.update(extra or {})
    return env


class ServiceServer:
    """A real uvicorn process serving the hora API (see the module docstring)."""

    def __init__(
        self,
        tmp: Path,
        users: dict[str, bool] | None = None,
        cpu_slots: int = 4,
        env: dict[str, str] | None = None,
        startup_timeout: float = 60.0,
        accounts: dict[str, int] | None = None,
    ) -> None:
        self.data_dir = tmp / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # the port is bound here and held until the server takes the socket: between a free
        # port's choice and uvicorn's own bind seconds later, another test's server (on the
        # other pytest-xdist workers) could take it, and this one's /healthz would then be
        # answered by that server, whose tokens differ
        self._sock: socket.socket | None = None
        for _ in range(20):  # a port lost between free_port() and the bind: another one
            self.port = free_port()
            self._sock = _bound(self.port)
            if self._sock is not None:
                break
        else:
            raise RuntimeError("no free port could be bound for the server in 20 tries")
        self.url = f"http://127.0.0.1:{self.port}"
        root = (env or {}).get("HORA_WORK_ROOT")
        self.tokens = make_users(
            self.data_dir,
            users if users is not None else {"ann": False, "root": True},
            accounts,
            Path(root) if root else None,
        )
        self.log_file = tmp / f"server-{self.port}.log"
        multi = {"HORA_USER_MODE": "multi"} if accounts else {}
        self.env = server_env(self.data_dir, self.port, cpu_slots, {**multi, **(env or {})})
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.seen: set[int] = set()
        self._sampling = threading.Event()
        self._sampler: threading.Thread | None = None

    def auth(self, user: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[user]}"}

    def client(self, user: str, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers=self.auth(user), timeout=timeout, verify=tls()
        )

    def start(self) -> ServiceServer:
        sock = self._sock or _bound(self.port)  # a restart binds the same port again
        self._sock = None
        if sock is None:
            raise RuntimeError(f"port {self.port} was taken before the server restarted")
        try:
            with self.log_file.open("ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", SERVE],
                    env={**self.env, LISTEN_FD: str(sock.fileno())},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    pass_fds=(sock.fileno(),),
                )
        finally:
            sock.close()  # the server holds it now: once it stops, connections are refused
        if self._answers_health(time.monotonic() + self.startup_timeout):
            self._start_sampler()
            return self
        self.kill()
        raise TimeoutError(
            f"server did not answer /healthz in {self.startup_timeout}s:\n{self.output()}"
        )

    def _answers_health(self, deadline: float) -> bool:
        """Whether the server answers /healthz before ``deadline`` (one client for every try)."""
        proc = self.proc
        assert proc is not None
        with httpx.Client(timeout=2, verify=tls()) as probe:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}:\n{self.output()}")
                try:
                    # 503: up, but its store is degraded (a full disk in a test)
                    if probe.get(self.url + "/healthz").status_code in (200, 503):
                        return True
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        return False

    def _start_sampler(self) -> None:
        # job ranks are children of the server; remember every one we ever see
        self._sampling.set()

        def sample() -> None:
            while self._sampling.is_set():
                self.descendants()
                time.sleep(0.2)

        self._sampler = threading.Thread(target=sample, daemon=True)
        self._sampler.start()

    def output(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def descendants(self) -> set[int]:
        if self.proc is None:
            return set()
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return set()
        found = {p.pid for p in kids}
        self.seen |= found
        return found

    def cancel_all(self, admin: str | None = None, timeout: float = 30.0) -> None:
        admin = admin or next((u for u in self.tokens if u in ("root", "admin")), None)
        if admin is None or self.proc is None or self.proc.poll() is not None:
            return
        with self.client(admin) as c:
            jobs = c.get("/v1/jobs", params={"limit": 500}).json()["items"]
            active = [j["id"] for j in jobs if j["state"] in ACTIVE]
            for job_id in active:
                c.post(f"/v1/jobs/{job_id}/cancel")
            deadline = time.monotonic() + timeout
            while active and time.monotonic() < deadline:
                active = [i for i in active if c.get(f"/v1/jobs/{i}").json()["state"] in ACTIVE]
                time.sleep(0.1)
        assert not active, f"jobs {active} did not stop within {timeout}s"

    def stop(self, grace: float = 20.0) -> None:
        if self.proc is None:
            return
        self.descendants()
        self._sampling.clear()
        if self._sampler is not None:
            self._sampler.join(timeout=5)
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(
                    f"server ignored SIGTERM for {grace}s:\n{self.output()}"
                ) from None

    def crash(self) -> None:
        """kill -9 the server process alone; the ranks it started live on in their sessions."""
        assert self.proc is not None
        self.descendants()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def restart(self) -> ServiceServer:
        """Start a new server on the same data dir and port (after :meth:`crash`)."""
        self._sampling.clear()
        if self._sampler is not None:
            self._sampler.join(timeout=5)
        return self.start()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def assert_nothing_left(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        alive = self._alive()
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = self._alive()
        for pid in alive:  # don't leak them into other tests, but fail this one
            _kill_pid(pid)
        assert not alive, f"processes left running after the server stopped: {sorted(alive)}"

    def _alive(self) -> set[int]:
        out = set()
        for pid in self.seen:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    out.add(pid)
            except psutil.NoSuchProcess:
                pass
        return out

    def __enter__(self) -> ServiceServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        try:
            self.cancel_all()
        finally:
            self.stop()
            self.assert_nothing_left()


def _bound(port: int) -> socket.socket | None:
    """A TCP socket bound to 127.0.0.1:``port`` (not listening: until the server listens,
    connections are refused), or None when the port is taken."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind does
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_state(
    client: httpx.Client, job_id: int, states: tuple[str, ...], timeout: float = 60.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job.get("state") in states:
            return job
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} not in {states} after {timeout}s: {job}")
