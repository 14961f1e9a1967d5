"""Rank shim: runs one rank's command and records its pid and exit status in files.

Control plane helper, started by the local runtime as
``python -S shim.py RUN_DIR RANK -- COMMAND...`` in the rank's own session, with the rank's
log file as stdout and stderr. It writes ``RUN_DIR/rank<R>.pid`` first, starts the command
(which inherits the log, environment, working directory and process group), waits, and
writes ``RUN_DIR/rank<R>.exit`` (the exit code; minus the signal number when killed) before
exiting with the same status. The files let a restarted service re-adopt a running rank and
learn how a finished one ended even though it is no longer the rank's parent.

Standard library only and no ``site`` import: this must start in milliseconds. Its signal
handlers are its first statements; a signal in the few milliseconds before them ends the
shim before it starts the command (the monitor then sees the rank gone).
"""

import os
import signal
import subprocess
import sys


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


_early: list[int] = []  # signals that came before the command existed
_started = False


def _on_signal(signum: int, frame: object) -> None:
    # the service signals the whole process group, so a running command got it too; the
    # shim stays alive to record how the command ends. One that came before the command
    # started is passed on as soon as it has.
    if not _started:
        _early.append(signum)


def main(argv: list[str]) -> int:
    """Run ``argv = [RUN_DIR, RANK, "--", COMMAND...]``; return the command's status."""
    global _started
    for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(stop, _on_signal)
    run_dir, rank, sep, command = argv[0], int(argv[1]), argv[2], argv[3:]
    if sep != "--" or not command:
        sys.stderr.write("usage: shim.py RUN_DIR RANK -- COMMAND...\n")
        return 2
    base = os.path.join(run_dir, f"rank{rank}")
    _write(base + ".pid", str(os.getpid()))
    try:
        child = subprocess.Popen(command)
        _started = True
        for sig in _early:
            child.send_signal(sig)
    except OSError as e:
        sys.stderr.write(f"hora: cannot start {command[0]!r}: {e.strerror or e}\n")
        _write(base + ".exit", "127")
        return 127
    code = child.wait()
    _write(base + ".exit", str(code))
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
