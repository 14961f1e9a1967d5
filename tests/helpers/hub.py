"""A real JupyterHub for tests: PAM accounts, LocalProcessSpawner, its proxy, hora as a service.

    with accounts(["ann", "bob"]) as users, Hub(base, users, hora_url, token) as hub:
        hub.login(page, users["ann"])

* :func:`accounts`: fresh OS accounts (``useradd``) with passwords the test sets
  (``chpasswd``), which the hub's PAM authenticator checks as it would anyone's; removed with
  their homes and processes afterwards.
* :func:`user_python`: the users' servers cannot run the test's own interpreter (a pyenv under
  ``/root``, mode 0700): a virtual environment of Debian's ``/usr/bin/python3`` (world-readable,
  outside ``/root``) whose ``.pth`` adds the test environment's packages (hora, JupyterLab,
  torch...), which every account can read.
* :class:`Kernel`: a kernel of a user's server, through the hub's proxy (REST, websocket).
* :class:`Hub`: ``jupyterhub`` with ``configurable-http-proxy`` on 127.0.0.1, its
  configuration written from :data:`CONFIG` (``hora_service.hub.configure`` adds hora to it);
  a service token for the test's own API calls. Stopping it stops the users' servers and the
  proxy; the helper checks that none of its processes is left.

Needs root (PAM reads ``/etc/shadow``; the spawner switches users).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import shutil
import signal
import site
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import websocket

from helpers.http_tls import tls
from helpers.service_server import free_port

PROXY = shutil.which("configurable-http-proxy")
CONFIG = """\
from hora_service.hub import configure
c.JupyterHub.bind_url = "http://{ip}:{proxy_port}"
c.JupyterHub.hub_ip = "{ip}"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api_port}"
c.ConfigurableHTTPProxy.pid_file = "{base}/proxy.pid"
c.JupyterHub.db_url = "sqlite:///{base}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{base}/jupyterhub_cookie_secret"
c.JupyterHub.log_level = "INFO"
c.Authenticator.allowed_users = {users!r}
c.Authenticator.admin_users = {admins!r}
c.Spawner.cmd = ["{bin}/jupyterhub-singleuser"]
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
# root's PATH would leak into the servers through env_keep: set theirs
c.Spawner.environment = {{"PATH": "{bin}:/usr/bin:/bin", "HORA_TEST_TAG": "{tag}"}}
c.JupyterHub.services = [
    {{"name": "test", "api_token": "{admin_token}"}},
    {{"name": "culler", "api_token": "{culler_token}"}},
]
c.JupyterHub.load_roles = [
    {{"name": "test", "services": ["test"],
      "scopes": ["admin:users", "admin:servers", "list:users", "read:users", "tokens"]}},
    {{"name": "culler", "services": ["culler"],
      "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"]}},
]
"""
# the notebooks reach hora through the hub's proxy, as a browser does
HORA = """\
# (hora may ask who the hub's admins are: whether they count is hora's HORA_HUB_ADMINS)
configure(c, "{hora_url}", api_token="{hora_token}", kernel_python="{python}",
          notebook_url="http://{ip}:{proxy_port}/services/hora", hub_admins=True)
"""
SCRIPT = "#!{python}\nimport sys\nfrom {module} import main\nsys.exit(main())\n"
SCRIPTS = {
    "jupyterhub-singleuser": "jupyterhub.singleuser",
    "batchspawner-singleuser": "batchspawner.singleuser",
}


class Kernel:
    """A kernel of a user's server, driven through the hub's proxy (REST and websocket).

    Args:
        server_url: the server's URL through the proxy (``.../user/NAME/``).
        token: a hub token with ``access:servers!user=NAME``.
        kernel_id: a running kernel of the server's; None: start a "hora" kernel.
        timeout: how long a reply may take, in seconds.
    """

    def __init__(
        self, server_url: str, token: str, kernel_id: str | None = None, timeout: float = 600
    ) -> None:
        self.url, self.token = server_url, token
        if kernel_id is None:
            made = httpx.post(f"{server_url}api/kernels", json={"name": "hora"},
                              headers=self.auth(), timeout=120)  # fmt: skip
            assert made.status_code == 201, made.text
            kernel_id = str(made.json()["id"])
        self.id = kernel_id
        self.session = uuid.uuid4().hex
        ws_url = server_url.replace("http://", "ws://") + f"api/kernels/{self.id}/channels"
        self.ws = websocket.create_connection(
            f"{ws_url}?session_id={self.session}", header=[f"Authorization: token {token}"],
            timeout=timeout,
        )  # fmt: skip

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}

    def interrupt(self) -> None:
        """Interrupt the kernel, as JupyterLab's button does (the server signals it)."""
        done = httpx.post(f"{self.url}api/kernels/{self.id}/interrupt", headers=self.auth(),
                          timeout=60)  # fmt: skip
        assert done.status_code == 204, done.text

    def run(self, code: str, on_output: Callable[[str], None] | None = None) -> str:
        """Execute ``code``; the text it printed and displayed (errors: ``ename: evalue``).

        ``on_output`` is called with the text so far each time more is printed.
        """
        msg_id = uuid.uuid4().hex
        header = {"msg_id": msg_id, "msg_type": "execute_request", "session": self.session,
                  "username": "test", "version": "5.3"}  # fmt: skip
        content = {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True,
        }  # fmt: skip
        msg = {"header": header, "parent_header": {}, "metadata": {}, "content": content,
               "channel": "shell", "buffers": []}  # fmt: skip
        self.ws.send(json.dumps(msg))
        out: list[str] = []
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, body = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(body["text"])
                if on_output:
                    on_output("".join(out))
            elif kind in ("display_data", "execute_result", "update_display_data"):
                out.append(body["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                out.append(f"{body['ename']}: {body['evalue']}\n" + "\n".join(body["traceback"]))
            elif kind == "status" and body["execution_state"] == "idle":
                return "".join(out)

    def close(self) -> None:
        self.ws.close()


@dataclass(frozen=True)
class Account:
    """An OS account a test made: its name, password and uid."""

    name: str
    password: str
    uid: int


def _remove_account(name: str) -> None:
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    for proc in psutil.process_iter(["uids"]):
        if proc.info["uids"] and proc.info["uids"].real == uid:
            try:
                proc.kill()
            except psutil.Error:
                pass
    subprocess.run(["userdel", "--remove", "--force", name], capture_output=True, timeout=60)


@contextmanager
def accounts(names: list[str]) -> Iterator[dict[str, Account]]:
    """Fresh OS accounts ``<name><random>`` with a login shell, a home and a password."""
    suffix = secrets.token_hex(3)
    made: dict[str, Account] = {}
    try:
        for name in names:
            account = f"{name}{suffix}"
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", account],
                           check=True, capture_output=True, timeout=60)  # fmt: skip
            password = secrets.token_urlsafe(12)
            subprocess.run(["chpasswd"], input=f"{account}:{password}", text=True, check=True,
                           capture_output=True, timeout=60)  # fmt: skip
            made[name] = Account(account, password, pwd.getpwnam(account).pw_uid)
        yield made
    finally:
        for who in made.values():
            _remove_account(who.name)


def user_python(where: Path) -> Path:
    """A Python every account can run, with the test environment's packages (module docstring)."""
    venv = where / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    packages = next(venv.glob("lib/python3*/site-packages"))
    ours = site.getsitepackages()[0]
    (packages / "hora_test_env.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    # Jupyter finds its server extensions and JupyterLab's assets under sys.prefix: share the
    # test environment's (the kernel specs stay the venv's own)
    (venv / "etc").mkdir(exist_ok=True)
    (venv / "etc" / "jupyter").symlink_to(Path(sys.prefix) / "etc" / "jupyter")
    data = venv / "share" / "jupyter"
    data.mkdir(parents=True, exist_ok=True)
    for entry in (Path(sys.prefix) / "share" / "jupyter").iterdir():
        if entry.name != "kernels":
            (data / entry.name).symlink_to(entry)
    python = venv / "bin" / "python"
    for name, module in SCRIPTS.items():  # the test environment's own start the pyenv Python
        (venv / "bin" / name).write_text(SCRIPT.format(python=python, module=module))
        (venv / "bin" / name).chmod(0o755)
    for path in [where, *where.rglob("*")]:
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0))
    return venv / "bin" / "python"


class Hub:
    """A running JupyterHub with hora as its service (see the module docstring)."""

    def __init__(
        self,
        base: Path,
        users: dict[str, Account],
        admins: list[str],
        hora_token: str,
        python: Path,
        tag: str,
        ip: str = "127.0.0.1",
    ) -> None:
        self.base = base
        self.port, self.hub_port, self.api_port = free_port(), free_port(), free_port()
        self.url = f"http://{ip}:{self.port}"
        self.api_url = f"http://{ip}:{self.hub_port}/hub/api"  # the hub's own, for hora
        self.admin_token = secrets.token_hex(32)
        self.culler_token = secrets.token_hex(32)
        self.tag = tag
        self.fields = {
            "proxy_port": self.port, "hub_port": self.hub_port, "proxy_api_port": self.api_port,
            "base": base, "users": {a.name for a in users.values()},
            "admins": {users[n].name for n in admins}, "python": python, "bin": python.parent,
            "tag": tag, "admin_token": self.admin_token, "culler_token": self.culler_token,
            "hora_token": hora_token, "ip": ip,
        }  # fmt: skip
        self.config = base / "jupyterhub_config.py"
        self.log = base / "jupyterhub.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.hora_url = ""
        self.hora = HORA  # how configure() is called; a test may put more configuration here
        self.env: dict[str, str] = {}  # more of the hub's environment

    def api(self, method: str, path: str, **kw: object) -> httpx.Response:
        """A call to the hub's REST API with the test's admin service token."""
        headers = {"Authorization": f"token {self.admin_token}"}
        return httpx.request(method, f"{self.url}/hub/api{path}", headers=headers, timeout=30,
                             **kw)  # type: ignore[arg-type]  # fmt: skip

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log.exists() else ""

    def start(self) -> Hub:
        assert PROXY, "configurable-http-proxy is not installed (scripts/install.sh test)"
        assert self.hora_url, "start hora first: a hub waits 30 s for a service that is down"
        text = (CONFIG + self.hora).format(**self.fields, hora_url=self.hora_url)
        self.config.write_text(text)
        env = {**os.environ, "HORA_TEST_TAG": self.tag, **self.env}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterhub", "-f", str(self.config)],
                cwd=self.base, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the hub exited:\n{self.output()}"
            try:  # the proxy answers 404 to everything until the hub adds its route
                if httpx.get(f"{self.url}/hub/api", timeout=2, verify=tls()).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the hub did not answer within 90 s:\n{self.output()}")

    def stop(self) -> None:
        """SIGTERM: the hub stops the users' servers and its proxy, then exits."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            raise AssertionError(f"the hub ignored SIGTERM for 60 s:\n{self.output()}") from None

    def browser_session(self, who: Account, next_url: str) -> httpx.Client:
        """An HTTP client signed in to the hub as ``who`` (its login form), then at ``next_url``.

        Redirects are followed, as a browser would: a service's OAuth sign-in included.
        """
        c = httpx.Client(base_url=self.url, follow_redirects=True, timeout=60)
        form = c.get("/hub/login").text
        xsrf = re.search(r'name="_xsrf" value="([^"]+)"', form)
        assert xsrf, form[:2000]
        done = c.post(f"/hub/login?next={next_url}", data={
            "username": who.name, "password": who.password, "_xsrf": xsrf[1],
        })  # fmt: skip
        assert done.status_code == 200 and next_url in str(done.url), (done.url, done.text[:500])
        return c

    def server(self, user: Account) -> dict[str, object] | None:
        """The user's default server as the hub has it (None: not running)."""
        model = self.api("GET", f"/users/{user.name}").json()
        return model.get("servers", {}).get("")  # type: ignore[no-any-return]

    def __enter__(self) -> Hub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
