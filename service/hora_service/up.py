"""``hora up``: the job service and JupyterLab with the hora kernel, in one command.

Control plane entry point. It builds the :class:`Settings` (single-user mode unless
``HORA_USER_MODE`` says otherwise: jobs run as the account that ran ``hora up``), makes sure
an admin user exists
(the first time it creates one, prints its token once and saves URL and token to
``~/.hora/config`` so that ``hora submit`` and ``hora.Client()`` work at once), installs the
"Python 3 (hora)" kernel under ``DATA_DIR/jupyter`` (visible to this JupyterLab only), starts
JupyterLab as a child process on 127.0.0.1 with a random token, and runs the service with
uvicorn in this process. JupyterLab serves a notebook directory of the user's (default
``~/hora-work``), not the repository: on start the example notebooks are copied into its
``notebooks/`` folder where missing (a user's copy is never overwritten), so edits and saved
outputs never touch the repository's files. Once JupyterLab answers and the service has
started, its few lines (the service, dashboard and JupyterLab URLs, the token) are printed and
saved to ``DATA_DIR/up.json`` (mode 0600) for ``hora up --print-urls``. JupyterLab's own log
goes to ``DATA_DIR/jupyterlab.log`` (``--lab-log`` shows it here instead), and the service
logs only warnings (``--verbose``: everything). Ctrl-C or SIGTERM stops
uvicorn, cancels the jobs still running (``--keep-jobs`` leaves them for the next start to
re-adopt), and stops JupyterLab's whole process group (SIGTERM, then SIGKILL after a grace
period), so nothing is left behind.
"""

from __future__ import annotations

import argparse
import getpass
import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, BinaryIO

from hora.client import load_config, save_config
from hora.procs import signal_group

from hora_service.settings import service_url

log = logging.getLogger(__name__)

LAB_STOP_GRACE_S = 10.0
LAB_READY_TIMEOUT_S = 180.0
LAB_QUIET_S = 1.0
DEFAULT_NOTEBOOK_DIR = Path("~/hora-work")
# the repository's example notebooks (present in a checkout; a wheel install has none)
EXAMPLES = Path(__file__).resolve().parents[2] / "notebooks"
STATE_FILE = "up.json"
LAB_LOG = "jupyterlab.log"


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``hora up``.

    Example:
        >>> build_parser().parse_args(["up", "--no-lab"]).no_lab
        True
    """
    p = argparse.ArgumentParser(prog="hora up", description="Start the job service and JupyterLab.")
    p.add_argument("cmd", choices=["up"], help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help="service address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="service port (default 8000)")
    p.add_argument("--lab-port", type=int, default=8888, help="JupyterLab port (default 8888)")
    p.add_argument("--data-dir", type=Path, default=None, help="state directory (default ~/.hora)")
    p.add_argument("--gpus", default=None, help="auto | N | 0,1,3 (default auto)")
    p.add_argument("--cpu-slots", type=int, default=None, help="schedulable slots without GPUs")
    p.add_argument(
        "--work-root", type=Path, default=None, help="jobs run under it (default: this directory)"
    )
    p.add_argument(
        "--notebook-dir",
        type=Path,
        default=None,
        help="directory JupyterLab serves; the examples are copied into it (default ~/hora-work)",
    )
    p.add_argument(
        "--print-urls",
        action="store_true",
        help="print the URLs and token of the running hora up, then exit",
    )
    p.add_argument("--no-lab", action="store_true", help="start only the service")
    p.add_argument(
        "--lab-log",
        action="store_true",
        help="show JupyterLab's log here (default: DATA_DIR/jupyterlab.log)",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="log the service's info lines")
    p.add_argument("--keep-jobs", action="store_true", help="leave running jobs alive on exit")
    p.add_argument("--dev", action="store_true", help="dev mode: relax the startup safety checks")
    return p


def settings_from_args(args: argparse.Namespace) -> Any:
    """The service :class:`Settings` for these arguments (unset ones keep their defaults)."""
    from hora_service.settings import Settings

    overrides: dict[str, Any] = {"host": args.host, "port": args.port}
    for key in ("data_dir", "gpus", "cpu_slots"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if args.work_root is not None:
        overrides["work_root"] = args.work_root
    elif "HORA_WORK_ROOT" not in os.environ:
        overrides["work_root"] = Path.cwd()  # the directory JupyterLab shows
    if args.dev:
        overrides["dev_mode"] = True
    if "HORA_USER_MODE" not in os.environ:
        # one person's service and notebooks: jobs run as whoever ran `hora up`, even root
        # (multi-user mode is `hora serve` as root, with `hora user add` per user)
        overrides["user_mode"] = "single"
    return Settings(**overrides)


def ensure_admin(manager: Any, url: str) -> tuple[str | None, bool]:
    """Find or create the admin token that ``hora up`` hands to the CLI and notebooks.

    A token from ``HORA_TOKEN`` or ``~/.hora/config`` that this service knows is reused (and
    the config file is updated with ``url``). Otherwise, when the store has no user at all, an
    admin named after the login is created and its token saved to the config file. When users
    exist but no known token is at hand, nothing is created.

    Returns:
        The token (None when unknown) and whether it was just created (printed once).
    """
    saved = load_config(url=url).token
    if saved and manager.users.for_token(saved) is not None:
        save_config(url, saved)
        return saved, False
    if manager.users.all():
        return None, False
    name = re.sub(r"[^A-Za-z0-9._-]", "-", getpass.getuser()).strip("-.") or "admin"
    token = str(manager.users.create(name, admin=True))
    save_config(url, token)
    return token, True


def token_line(token: str | None, new: bool, data_dir: Path) -> str:
    """What ``hora up`` prints about the token."""
    if token is None:
        return (
            "  token: none saved for this service; create one with "
            f"`hora user add NAME --admin --data-dir {data_dir}` and set HORA_TOKEN"
        )
    return f"  token: {token}" if new else "  token: saved in ~/.hora/config"


def install_kernel(data_dir: Path) -> Path | None:
    """Install the hora kernel spec under ``DATA_DIR/jupyter``; None if unavailable.

    Returns:
        The Jupyter data directory to put on ``JUPYTER_PATH``, or None.
    """
    try:
        from hora.engines.kernelspec import install_kernel_spec
    except ImportError as e:
        log.warning("hora kernel not installed (hora.engines.kernelspec unavailable: %s)", e)
        return None
    prefix = data_dir / "jupyter"
    # jupyter_client warns that this prefix is not on *this* process's kernel path; it is on
    # the JupyterLab child's JUPYTER_PATH (lab_env), which is all that matters here
    traitlets_log = logging.getLogger("traitlets")
    level = traitlets_log.level
    traitlets_log.setLevel(logging.ERROR)
    try:
        install_kernel_spec(prefix=str(prefix))
    finally:
        traitlets_log.setLevel(level)
    return prefix / "share" / "jupyter"


def seed_notebooks(root: Path, examples: Path = EXAMPLES) -> list[Path]:
    """Copy the example notebooks into ``root/notebooks`` where missing; return those copied.

    A notebook already there (the user's copy, maybe edited) is never overwritten.

    Example:
        >>> seed_notebooks(Path("/tmp/w"), Path("/nonexistent"))
        []
    """
    if not examples.is_dir():
        return []
    dest = root / "notebooks"
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for src in sorted(examples.glob("*.ipynb")):
        target = dest / src.name
        if not target.exists():
            shutil.copyfile(src, target)
            copied.append(target)
    return copied


def lab_argv(port: int, token: str, root: Path) -> list[str]:
    """The JupyterLab command line (an argument list; no shell).

    Example:
        >>> lab_argv(8888, "t", Path("/w"))[:4]
        ['...', '-m', 'jupyterlab', '--no-browser']
    """
    return [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip",
        "127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
    ] + (["--allow-root"] if os.geteuid() == 0 else [])


def lab_env(url: str, token: str | None, jupyter_path: Path | None) -> dict[str, str]:
    """Environment of the JupyterLab child: notebooks reach the service with HORA_URL/TOKEN."""
    env = dict(os.environ)
    env["HORA_URL"] = url
    if token:
        env["HORA_TOKEN"] = token
    if jupyter_path is not None:
        env["JUPYTER_PATH"] = os.pathsep.join(
            p for p in (str(jupyter_path), env.get("JUPYTER_PATH")) if p
        )
    return env


def start_lab(
    port: int,
    url: str,
    token: str | None,
    jupyter_path: Path | None,
    root: Path,
    log_file: Path | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start JupyterLab in its own process group, serving ``root``; return it and its token.

    Its log is appended to ``log_file`` (mode 0600: it holds the lab's token), or passed
    through to this process's stdout when ``log_file`` is None.
    """
    lab_token = secrets.token_urlsafe(24)
    proc = subprocess.Popen(
        lab_argv(port, lab_token, root),
        env=lab_env(url, token, jupyter_path),
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    sink = None
    if log_file is not None:
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        sink = os.fdopen(fd, "ab")
    threading.Thread(
        target=_pump, args=(proc, sink), name="hora-up-lab-log", daemon=True
    ).start()
    return proc, lab_token


# when JupyterLab last wrote a line (its log is passed through, so hora up knows when it is quiet)
_LAB_LAST_LINE = [0.0]


def _pump(proc: subprocess.Popen[bytes], sink: BinaryIO | None = None) -> None:
    assert proc.stdout is not None
    out = sink if sink is not None else sys.stdout.buffer
    shown = True
    try:
        for line in iter(proc.stdout.readline, b""):
            _LAB_LAST_LINE[0] = time.monotonic()
            if not shown:
                continue  # keep draining: a full pipe would stall JupyterLab
            try:
                out.write(line)
                out.flush()
            except (OSError, ValueError):  # our stdout went away (closed pipe), a full disk
                shown = False
    finally:
        if sink is not None:
            sink.close()


def wait_quiet(quiet_s: float = LAB_QUIET_S, timeout: float = 10.0) -> None:
    """Wait until JupyterLab has logged nothing for ``quiet_s`` (at most ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and time.monotonic() - _LAB_LAST_LINE[0] < quiet_s:
        time.sleep(0.1)


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = LAB_STOP_GRACE_S) -> None:
    """SIGTERM the process group of ``proc``, SIGKILL it after ``grace_s``; reap the leader."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        # not signal_group: a group we may not signal is an error to report here, not a
        # group that is gone
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace_s)
            if sig == signal.SIGTERM:
                _kill_leftovers(proc.pid)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait(timeout=grace_s)


def _kill_leftovers(pgid: int) -> None:
    # kernels that JupyterLab started stay in its group; don't let them outlive it
    signal_group(pgid, signal.SIGKILL)


def _watch(lab: subprocess.Popen[bytes], server: Any) -> None:
    """Stop the service too if JupyterLab dies on its own (hora up is one unit)."""

    def watch() -> None:
        while not server.should_exit:
            if lab.poll() is not None:
                log.error("JupyterLab exited with code %s; stopping hora up", lab.returncode)
                server.should_exit = True
                return
            time.sleep(0.5)

    threading.Thread(target=watch, name="hora-up-lab-watch", daemon=True).start()


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def lab_ready(port: int, lab: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait until JupyterLab answers HTTP on ``port``; False if it exits or does not in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and lab.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api", timeout=2):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            time.sleep(0.3)
    return False


def summary(
    service: str, token: str, lab: str | None, notebooks: Path | None, lab_log: str | None = None
) -> str:
    """The block ``hora up`` prints last (and ``--print-urls`` again).

    Example:
        >>> print(summary("http://h:1", "  token: t", None, None))
        hora service: http://h:1  (docs: http://h:1/docs)
          token: t
        dashboard:    http://h:1/ui  (sign in with the token)
        Press Ctrl-C to stop; `hora up --print-urls` prints this again.
    """
    lines = [f"hora service: {service}  (docs: {service}/docs)", token]
    lines.append(f"dashboard:    {service}/ui  (sign in with the token)")
    if lab is not None:
        lines.append(f"JupyterLab:   {lab}")
    if notebooks is not None:
        lines.append(f"  notebooks:  {notebooks}")
    if lab_log is not None:
        lines.append(f"  its log:    {lab_log}")
    lines.append("Press Ctrl-C to stop; `hora up --print-urls` prints this again.")
    return "\n".join(lines)


def write_state(data_dir: Path, state: dict[str, Any]) -> Path:
    """Save what ``--print-urls`` needs (the lab URL holds its token: mode 0600)."""
    path = data_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)
    return path


def _drop_state(data_dir: Path) -> None:
    # only this instance's: a second hora up that failed to start must not hide the first
    path = data_dir / STATE_FILE
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def print_urls(data_dir: Path) -> int:
    """``hora up --print-urls``: print the running instance's block; 1 if none runs."""
    path = data_dir / STATE_FILE
    try:
        state = json.loads(path.read_text())
        os.kill(int(state["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        sys.stderr.write(f"hora up: not running (no live instance recorded in {path})\n")
        return 1
    token = load_config(url=state["service"]).token
    line = f"  token: {token}" if token else token_line(None, False, data_dir)
    notebooks = Path(state["notebooks"]) if state.get("notebooks") else None
    _say(summary(state["service"], line, state.get("lab"), notebooks, state.get("lab_log")))
    return 0


def _announce(
    args: argparse.Namespace,
    server: Any,
    lab: subprocess.Popen[bytes] | None,
    block: dict[str, Any],
    data_dir: Path,
) -> None:
    """Print the URLs and token once the service and JupyterLab are up (after their logs)."""

    def wait_then_print() -> None:
        deadline = time.monotonic() + LAB_READY_TIMEOUT_S
        while not server.started and time.monotonic() < deadline and not server.should_exit:
            time.sleep(0.1)
        if lab is not None:
            if not lab_ready(args.lab_port, lab, deadline - time.monotonic()):
                log.warning("JupyterLab did not answer within %.0fs", LAB_READY_TIMEOUT_S)
            wait_quiet()  # its start-up log ends a moment after it answers
        if server.should_exit:
            return
        write_state(
            data_dir, {k: v for k, v in block.items() if k != "token"} | {"pid": os.getpid()}
        )
        notebooks = Path(block["notebooks"]) if block.get("notebooks") else None
        _say(
            summary(
                block["service"], block["token"], block.get("lab"), notebooks, block.get("lab_log")
            )
        )

    threading.Thread(target=wait_then_print, name="hora-up-announce", daemon=True).start()


def run(args: argparse.Namespace) -> int:
    """Start everything, block until Ctrl-C/SIGTERM, stop everything; return the exit code."""
    import uvicorn

    from hora_service.api.app import create_app
    from hora_service.cli import interrupt
    from hora_service.manager import JobManager

    settings = settings_from_args(args)
    data_dir = Path(settings.data_dir)
    if args.print_urls:
        return print_urls(data_dir)
    url = service_url(args.host, args.port)
    manager = JobManager(settings)
    manager.start()
    lab: subprocess.Popen[bytes] | None = None
    try:
        token, new = ensure_admin(manager, url)
        app = create_app(settings, manager)
        server = uvicorn.Server(
            uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
        )
        block: dict[str, Any] = {"service": url, "token": token_line(token, new, data_dir)}
        if not args.no_lab:
            root = (args.notebook_dir or DEFAULT_NOTEBOOK_DIR).expanduser().resolve()
            root.mkdir(parents=True, exist_ok=True)
            seed_notebooks(root)
            lab_log = None if args.lab_log else data_dir / LAB_LOG
            lab, lab_token = start_lab(
                args.lab_port, url, token, install_kernel(data_dir), root, lab_log
            )
            block["lab"] = f"http://127.0.0.1:{args.lab_port}/lab?token={lab_token}"
            block["notebooks"] = str(root / "notebooks") if EXAMPLES.is_dir() else str(root)
            if lab_log is not None:
                block["lab_log"] = str(lab_log)
        _say("hora up: starting the service" + ("" if lab is None else " and JupyterLab") + "...")
        signal.signal(signal.SIGTERM, interrupt)
        if lab is not None:
            _watch(lab, server)
        _announce(args, server, lab, block, data_dir)
        server.run()  # handles SIGINT/SIGTERM itself, then re-raises them after shutdown
        return 0 if server.started and (lab is None or lab.poll() is None) else 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not skip the cleanup
        _drop_state(data_dir)
        if not args.keep_jobs and hasattr(manager, "shutdown_jobs"):
            manager.shutdown_jobs()
        manager.stop()
        if lab is not None:
            stop_group(lab)
        _say("hora up: stopped")


def main(argv: list[str]) -> int:
    """``hora up``: see the module docstring.

    Args:
        argv: ``["up", ...options]``.

    Returns:
        0 after a clean stop, 1 when something failed to start.
    """
    from hora.errors import HoraError

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except HoraError as e:
        sys.stderr.write(f"hora up: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        return 0
