"""What :mod:`hora_service.runtimes.startcheck` checks, as whoever runs it (control plane helper).

Standard library only: in multi-user mode the service runs this file by its path as
``python -I -S startcheck_child.py JSON`` (as root); it drops to the job's account (the
supplementary groups cleared, then the gid, then the uid, as the rank shim does) and prints
what :func:`inspect` found. In the other modes the service calls :func:`inspect` itself (the
job runs as the service's own account). Every path is checked absolute (nothing changes the
current directory), with ``os.access``, which asks with the real uid: the account's, once
dropped.

A job with a private ``/tmp`` (a fresh one in its own mount namespace) sees of the host's
``/tmp`` and ``/dev/shm`` only what stays visible: the directories the service keeps
(``visible``) and those it was given (``given``: its ``PATH``, ``PYTHONPATH`` and
environment directories) that its account reaches without a symlink. :func:`inspect` finds
which of those it reaches (``keep``, returned to the service, which binds them into the
namespace) and looks at every other path under them as the job will: not there.
"""

import errno
import json
import os
import stat
import sys

PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
ENV_DIRS = ("VIRTUAL_ENV", "CONDA_PREFIX")


def _under(path: str, dirs: "list[str] | tuple[str, ...]") -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in dirs)


class View:
    """Paths as a job sees them: with a private ``/tmp``, only the kept ones under it."""

    def __init__(self, private_tmp: bool, visible: "list[str]") -> None:
        self.private_tmp = private_tmp
        self.visible = visible

    def hides(self, path: str) -> bool:
        """Whether the job's private ``/tmp`` (or ``/dev/shm``) hides ``path``."""
        path = os.path.normpath(path)
        return self.private_tmp and _under(path, PRIVATE_DIRS) and not _under(path, self.visible)

    def hidden(self, path: str) -> str:
        """Why ``path`` is not there for the job (it lies under its private /tmp)."""
        top = next(d for d in PRIVATE_DIRS if _under(os.path.normpath(path), (d,)))
        return (
            f"{path} is hidden from the job: its {top} is its own, where only its working "
            "directory, the work root, the setting job_tmp_paths and the directories of its "
            "PATH, PYTHONPATH, VIRTUAL_ENV and CONDA_PREFIX that its account reaches without "
            "a symlink stay visible"
        )


def reachable(path: str) -> bool:
    """Whether ``path`` is a directory reached from ``/`` through real directories only.

    Each component must be a directory (never a symlink) this process may search.
    """
    if not path.startswith("/") or ".." in path.split("/"):
        return False
    at = "/"
    for part in [p for p in path.split("/") if p]:
        at = os.path.join(at, part)
        try:
            st = os.lstat(at)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or not os.access(at, os.X_OK):
            return False
    return True


def _usable(path: str, who: str, view: View) -> "str | None":
    """None: no such file; "": it can be executed; else why it cannot (as the job sees it)."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        target = os.path.realpath(path)  # a venv's python is a link into a private directory
        leads = f" (it leads to {target})" if target != path else ""
        return f"{path}{leads}: {e.strerror}"
    if view.hides(path):
        return view.hidden(path)
    target = os.path.realpath(path)
    if view.hides(target):
        return f"{path} leads to {target}; {view.hidden(target)}"
    if stat.S_ISDIR(st.st_mode):
        return f"{path} is a directory"
    if not os.access(path, os.X_OK):
        mode = stat.S_IMODE(st.st_mode)
        return f"{who} cannot execute {path} (mode {mode:04o}, uid {st.st_uid})"
    return _interpreter(path, who, view)


def _interpreter(path: str, who: str, view: View) -> str:
    """"" if ``path``'s ``#!`` interpreter (if any) can run, else why not."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return ""  # executable but unreadable: a binary, fine
    if not head.startswith(b"#!"):
        return ""
    interp = head[2:].split(b"\n")[0].strip().split(b" ")[0].decode(errors="replace")
    if view.hides(interp):
        return f"{path} starts with #!{interp}; {view.hidden(interp)}"
    if not interp.startswith("/") or os.access(interp, os.X_OK):
        return ""
    try:
        os.stat(interp)
        why = "not executable"
    except PermissionError:
        why = "not reachable"
    except OSError:
        why = "not found"
    return f"{path} starts with #!{interp}, which is {why} for {who}"


def _program(prog: str, wd: str, path_env: str, who: str, view: View) -> "dict[str, str]":
    if "/" in prog:
        full = os.path.join(wd, prog)
        why = _usable(full, who, view)
        if why is None:
            return {"field": "command", "message": f"{full} does not exist (as seen by {who})"}
        return {"field": "command", "message": why} if why else {}
    problems = []
    for d in path_env.split(os.pathsep):
        where = os.path.join(wd, d, prog)  # a relative entry: from the workdir
        why = _usable(where, who, view)
        if why == "":
            return {}
        if why is not None:
            problems.append(why)
    more = ("; " + "; ".join(problems[:3])) if problems else ""
    message = f"{prog!r} is not found on the job's PATH ({path_env}) by {who}{more}"
    return {"field": "command", "message": message}


def _env_dirs(env: "dict[str, str]", who: str, view: View) -> "dict[str, str]":
    """The job's VIRTUAL_ENV and CONDA_PREFIX: directories its account can enter and read."""
    for name in ENV_DIRS:
        path = env.get(name)
        if not path:
            continue
        why = _enter(path)  # as the account on the host first: Permission denied says most
        why = f"{who} cannot use {path}: {why}" if why else ""
        if not why and view.hides(path):
            why = view.hidden(path)
        if why:
            message = (
                f"{why} ({name} in the job's env, which hora submit and the client take from "
                "where the job is submitted; a job runs as its account: use an environment it "
                "can read, or submit with --export NONE)"
            )
            return {"field": f"env.{name}", "message": message}
    return {}


def _enter(path: str) -> str:
    """"" if this process can enter and list directory ``path``, else why not."""
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except OSError as e:
        return str(e.strerror)
    if not is_dir:
        return "Not a directory"
    if not os.access(path, os.X_OK):
        return "Permission denied"
    return "" if os.access(path, os.R_OK) else "Permission denied (it cannot list it)"


def inspect(args: "dict[str, object]") -> "dict[str, object]":
    """``{"keep": [...]}`` if the job can start, else the field and why it cannot.

    ``args``: ``who`` (the account, in words), ``workdir`` (absolute), ``writable``,
    ``program`` (None: the directory only), ``path`` (the job's ``PATH``), ``env`` (its
    ``VIRTUAL_ENV`` and ``CONDA_PREFIX``, if checked), ``private_tmp`` (it gets its own
    ``/tmp``), ``visible`` (what stays visible there anyway) and ``given`` (directories it
    was given; those it reaches are returned as ``keep``).
    """
    who, wd = str(args["who"]), str(args["workdir"])
    private = bool(args.get("private_tmp"))
    keep = [p for p in _strings(args.get("given")) if reachable(p)] if private else []
    view = View(private, _strings(args.get("visible")) + keep)
    why = _enter(wd)
    if not why and args.get("writable") and not os.access(wd, os.W_OK):
        why = "Permission denied (it cannot write in it)"
    if why:
        message = f"{who} cannot enter the working directory {wd}: {why}"
        return {"field": "working_dir", "message": message}
    env = args.get("env")
    found = _env_dirs({str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {},
                      who, view)  # fmt: skip
    prog = args.get("program")
    if not found and prog:
        found = _program(str(prog), wd, str(args["path"]), who, view)
    return dict(found) if found else {"keep": keep}


def _strings(value: object) -> "list[str]":
    return [str(v) for v in value] if isinstance(value, list) else []


def main(argv: "list[str]") -> int:
    """Drop to ``uid``/``gid`` of ``argv[0]`` (JSON), then print what :func:`inspect` found."""
    args = json.loads(argv[0])
    uid, gid = args.get("uid"), args.get("gid")
    if isinstance(uid, int) and isinstance(gid, int):
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    print(json.dumps(inspect(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
