"""What :mod:`hora_service.runtimes.preflight` checks, as whoever runs it (control plane helper).

Standard library only: in multi-user mode the service runs this file by its path as
``python -I -S preflight_child.py JSON`` (as root); it drops to the job's account (the
supplementary groups cleared, then the gid, then the uid, as the rank shim does) and prints
what :func:`inspect` found. In the other modes the service calls :func:`inspect` itself (the
job runs as the service's own account). Every path is checked absolute (nothing changes the
current directory), with ``os.access``, which asks with the real uid: the account's, once
dropped.
"""

import errno
import json
import os
import stat
import sys


def _usable(path: str, who: str) -> "str | None":
    """None: no such file; "": it can be executed; else why it cannot."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        target = os.path.realpath(path)  # a venv's python is a link into a private directory
        leads = f" (it leads to {target})" if target != path else ""
        return f"{path}{leads}: {e.strerror}"
    if stat.S_ISDIR(st.st_mode):
        return f"{path} is a directory"
    if not os.access(path, os.X_OK):
        mode = stat.S_IMODE(st.st_mode)
        return f"{who} cannot execute {path} (mode {mode:04o}, uid {st.st_uid})"
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return ""  # executable but unreadable: a binary, fine
    if not head.startswith(b"#!"):
        return ""
    interp = head[2:].split(b"\n")[0].strip().split(b" ")[0].decode(errors="replace")
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


def _program(prog: str, wd: str, path_env: str, who: str) -> "dict[str, str]":
    if "/" in prog:
        full = os.path.join(wd, prog)
        why = _usable(full, who)
        if why is None:
            return {"field": "command", "message": f"{full} does not exist (as seen by {who})"}
        return {"field": "command", "message": why} if why else {}
    problems = []
    for d in path_env.split(os.pathsep):
        why = _usable(os.path.join(wd, d, prog), who)  # a relative entry: from the workdir
        if why == "":
            return {}
        if why is not None:
            problems.append(why)
    more = ("; " + "; ".join(problems[:3])) if problems else ""
    message = f"{prog!r} is not found on the job's PATH ({path_env}) by {who}{more}"
    return {"field": "command", "message": message}


def inspect(args: "dict[str, object]") -> "dict[str, str]":
    """``{}`` if the working directory and the program are usable, else the field and why.

    ``args``: ``who`` (the account, in words), ``workdir`` (absolute), ``writable``,
    ``program`` (None: the directory only) and ``path`` (the job's ``PATH``).
    """
    who, wd = str(args["who"]), str(args["workdir"])
    try:
        is_dir = stat.S_ISDIR(os.stat(wd).st_mode)
    except OSError as e:
        why = e.strerror
    else:
        why = "Permission denied" if is_dir else "Not a directory"
        if is_dir and os.access(wd, os.X_OK):
            why = "" if os.access(wd, os.R_OK) else "Permission denied (it cannot list it)"
    if not why and args.get("writable") and not os.access(wd, os.W_OK):
        why = "Permission denied (it cannot write in it)"
    if why:
        message = f"{who} cannot enter the working directory {wd}: {why}"
        return {"field": "working_dir", "message": message}
    prog = args.get("program")
    return _program(str(prog), wd, str(args["path"]), who) if prog else {}


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
