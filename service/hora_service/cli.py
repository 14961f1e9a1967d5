"""``hora serve`` and ``hora user``: run the job service, manage its users (control plane).

``hora serve [--host H] [--port P] [--data-dir DIR] [--gpus auto|N|LIST] [--cpu-slots N]
[--work-root DIR] [--quota N] [--dev] [--hub]`` runs uvicorn with the FastAPI app; every
option falls back to its ``HORA_*`` variable, then to the default. ``--hub`` runs it as a
JupyterHub service (see :mod:`hora_service.hub`). Stopping it (Ctrl-C, SIGTERM)
leaves running jobs alive; the next start re-adopts them.

``hora user add NAME [--admin] [--quota N] [--uid N] [--idle-timeout S] [--work-root DIR]
[--data-dir DIR]`` prints the new user's token once (only its hash is stored). In multi-user
mode (the service runs as root) it also creates the OS account ``hora-NAME`` the user's jobs
run as (home 0700), or assigns the existing account ``--uid N``, and makes the user's working
directory ``WORK_ROOT/NAME`` (see :mod:`hora_service.users.homes`); in single-user mode it refuses
a second user (see :mod:`hora_service.identity`). ``hora user set NAME --idle-timeout
S|none`` changes the idle timeout of the user's new notebook sessions (``none``: the
service's default); ``--memory``, ``--pids`` and ``--cpus`` set their own job limits per
attempt (``auto``, ``none``, a value, or ``default``: the service's setting; see
:mod:`hora_service.runtimes.limits`). ``hora user list`` and ``hora user remove NAME`` do what
they say; removing a user keeps their OS
account (it may own their files).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from hora.errors import HoraError

SETTING_ARGS = ("host", "port", "data_dir", "gpus", "cpu_slots", "work_root")
UNSET: Any = object()  # an option not given (None means "back to the default")
IDLE_HELP = "idle timeout in seconds of this user's notebook sessions that ask for none"


def idle_seconds(value: str) -> float | None:
    """``--idle-timeout``: seconds, or ``none`` (range checks are the store's, with the field).

    Example:
        >>> idle_seconds("900"), idle_seconds("none")
        (900.0, None)
    """
    if value.strip().lower() == "none":
        return None
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds or none") from None


def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``hora serve`` and ``hora user``.

    Example:
        >>> build_parser().parse_args(["user", "add", "ann", "--admin"]).admin
        True
    """
    p = argparse.ArgumentParser(prog="hora", description="The hora job service.")
    sub = p.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="start the job service")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="TCP port (default 8000)")
    _data_dir(serve)
    serve.add_argument("--gpus", help="auto | N | 0,1,3 (default auto)")
    serve.add_argument("--cpu-slots", type=int, help="slots without GPUs (default 2)")
    serve.add_argument("--work-root", type=Path, help="jobs' working dirs live under it")
    serve.add_argument("--quota", type=int, help="default per-user GPU quota")
    serve.add_argument("--dev", action="store_true", help="relax the startup safety checks")
    serve.add_argument(
        "--hub", action="store_true",
        help="run as a JupyterHub service: sign in through the hub (see HORA_HUB_*)",
    )  # fmt: skip
    user = sub.add_parser("user", help="manage users and tokens")
    verbs = user.add_subparsers(dest="verb", required=True)
    add = verbs.add_parser("add", help="create a user and print their token")
    add.add_argument("name")
    add.add_argument("--admin", action="store_true", help="sees and acts on every job")
    add.add_argument("--quota", type=int, help="most GPUs this user's jobs may hold")
    add.add_argument(
        "--uid", type=int, help="multi-user mode: run this user's jobs as this existing OS account"
    )
    add.add_argument(
        "--idle-timeout", type=idle_seconds, metavar="S", help=IDLE_HELP + " (default: none)"
    )
    add.add_argument(
        "--work-root", type=Path, help="multi-user mode: where their working directory is made"
    )
    _data_dir(add)
    change = verbs.add_parser("set", help="change a user's settings")
    change.add_argument("name")
    change.add_argument(
        "--idle-timeout", type=idle_seconds, metavar="S|none", default=UNSET,
        help=IDLE_HELP + "; none: the service's default",
    )  # fmt: skip
    for kind, example in (("memory", "16g"), ("pids", "8192"), ("cpus", "4")):
        change.add_argument(
            f"--{kind}", metavar="VALUE",
            help=f"this user's {kind} limit per attempt: auto, none, a value ({example}), or "
            "default (the service's setting)",
        )  # fmt: skip
    _data_dir(change)
    _data_dir(verbs.add_parser("list", help="list users"))
    remove = verbs.add_parser("remove", help="delete a user (their token stops working)")
    remove.add_argument("name")
    _data_dir(remove)
    return p


def _data_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, help="state directory (default ~/.hora)")


def settings_from_args(args: argparse.Namespace) -> Any:
    """The :class:`Settings` for these arguments (unset ones come from HORA_* or defaults)."""
    from hora_service.settings import Settings

    overrides: dict[str, Any] = {
        k: getattr(args, k) for k in SETTING_ARGS if getattr(args, k, None) is not None
    }
    if getattr(args, "quota", None) is not None and args.cmd == "serve":
        overrides["user_gpu_quota"] = args.quota
    if getattr(args, "dev", False):
        overrides["dev_mode"] = True
    if getattr(args, "hub", False):
        overrides["hub"] = True
    return Settings(**overrides)


def serve(args: argparse.Namespace) -> int:
    """Run the service until Ctrl-C or SIGTERM."""
    import uvicorn

    from hora_service.api.app import create_app
    from hora_service.manager import JobManager

    settings = settings_from_args(args)
    manager = JobManager(settings)
    manager.start()  # a second service on the data directory is refused here, in one line
    try:
        where = f"http://{settings.host}:{settings.port} (state in {settings.data_dir})"
        sys.stdout.write(f"hora service on {where}\n")
        sys.stdout.flush()
        app = create_app(settings, manager)
        server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port))
        # uvicorn shuts down cleanly on SIGINT/SIGTERM, then re-raises the signal: make that
        # a KeyboardInterrupt so that a requested stop exits 0
        signal.signal(signal.SIGTERM, interrupt)
        try:
            server.run()
        except KeyboardInterrupt:
            pass
    finally:
        manager.stop()
    return 0 if server.started else 1


def interrupt(signum: int, frame: object) -> None:
    """Signal handler that turns SIGTERM into a KeyboardInterrupt (a clean, requested stop)."""
    raise KeyboardInterrupt


def user(args: argparse.Namespace) -> int:
    """``hora user add|set|list|remove``."""
    from hora_service.manager import JobManager

    manager = JobManager(settings_from_args(args))
    try:
        if args.verb == "add":
            token = manager.users.create(
                args.name, admin=args.admin, quota=args.quota, uid=args.uid, make_account=True,
                idle_timeout_s=args.idle_timeout,
            )  # fmt: skip
            sys.stdout.write(f"{token}\n")
            found = manager.open_store().user_by_name(args.name)
            runs = f"; jobs run as uid {found.os_uid}" if found and found.os_uid else ""
            sys.stderr.write(
                f"created {'admin ' if args.admin else ''}user {args.name}{runs}; "
                "the token above is shown only once\n"
            )
        elif args.verb == "set":
            return set_user(manager, args)
        elif args.verb == "list":
            for u in manager.users.all():
                sys.stdout.write(user_line(u) + "\n")
        elif not manager.users.remove(args.name):
            sys.stderr.write(f"hora user: no user {args.name!r}\n")
            return 1
    finally:
        manager.close_store()
    return 0


def set_user(manager: Any, args: argparse.Namespace) -> int:
    """``hora user set``: 0, or 1 with one line on stderr when there is no such user."""
    name, idle_timeout_s = args.name, args.idle_timeout
    changes = {k: getattr(args, k) for k in ("memory", "pids", "cpus") if getattr(args, k)}
    if idle_timeout_s is UNSET and not changes:
        sys.stderr.write("hora user set: nothing to change (--idle-timeout, --memory, ...)\n")
        return 2
    if idle_timeout_s is not UNSET and not manager.users.set_idle_timeout(name, idle_timeout_s):
        sys.stderr.write(f"hora user: no user {name!r}\n")
        return 1
    if changes and not manager.users.set_limits(name, changes):
        sys.stderr.write(f"hora user: no user {name!r}\n")
        return 1
    if idle_timeout_s is not UNSET:
        idle = "the service's default" if idle_timeout_s is None else f"{idle_timeout_s:g}s"
        sys.stderr.write(f"user {name}: idle timeout of new sessions: {idle}\n")
    if changes:
        own = manager.users.limits_of(name)
        sys.stderr.write(f"user {name}: job limits: {_limits_text(own) or 'the defaults'}\n")
    return 0


def _limits_text(limits: dict[str, str]) -> str:
    return "  ".join(f"{k}={v}" for k, v in sorted(limits.items()))


def user_line(u: Any) -> str:
    """One user as ``hora user list`` shows them.

    Example:
        >>> user_line(User(name="ann", gpu_quota=2, idle_timeout_s=900))  # doctest: +SKIP
        'ann  quota=2  idle_timeout=900s'
    """
    line = u.name + ("  (admin)" if u.is_admin else "")
    line += "" if u.gpu_quota is None else f"  quota={u.gpu_quota}"
    line += "" if u.os_uid is None else f"  uid={u.os_uid}"
    line += "" if u.idle_timeout_s is None else f"  idle_timeout={u.idle_timeout_s:g}s"
    return line + (f"  {_limits_text(u.limits)}" if u.limits else "")


def main(argv: list[str]) -> int:
    """Entry point for ``hora serve`` and ``hora user`` (``argv`` starts with the command).

    Returns:
        0 on success, 1 on an error (one line on stderr), 2 on a usage error.
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        return serve(args) if args.cmd == "serve" else user(args)
    except (HoraError, ValueError) as e:
        sys.stderr.write(f"hora {args.cmd}: error: {e}\n")
        return 1
    except Exception as e:
        from hora_service.store.db import is_unavailable

        if not is_unavailable(e):
            raise
        # a full disk, a locked or broken store: one line that says so, not a traceback
        why = str(getattr(e, "orig", None) or e).splitlines()[0]
        data_dir = settings_from_args(args).data_dir
        with contextlib.suppress(OSError):
            if shutil.disk_usage(data_dir).free < 1 << 20:
                why += " (its disk is full)"
        sys.stderr.write(f"hora {args.cmd}: error: cannot use the store in {data_dir}: {why}\n")
        return 1
