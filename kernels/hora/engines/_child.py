"""Entry point of the processes hora starts for a notebook: the controller and the engines.

``python -m hora.engines._child controller|engine [ipyparallel args]`` (data plane). Around
ipyparallel's own ``main`` it adds what the notebook needs:

* a watchdog that exits when the notebook kernel (the parent) is gone, so a killed kernel
  leaves no orphans; what the controller forks (its heart monitor) watches the controller in
  turn, so a controller killed outright leaves none either;
* in engines, ``faulthandler`` on fatal signals (a segfault's stack lands in the engine log)
  and on SIGUSR1 (the kernel asks for a stuck rank's current stack, written to a per-engine file);
* in engines, torch is imported and ``hora.torch.init()`` runs in a background thread while
  the engine registers with the controller (cold start overlaps the two).

``session-engine`` is an engine the hora service starts for a notebook's session (see
``hora_service.sessions``): it reads the controller's engine connection info from
``HORA_ENGINE_CONNECTION`` (JSON checked by the service), writes it and its stack file into a
private directory of its own (the connection file is removed once ipyparallel has read it), and
runs as an engine; its parent is the service's rank shim.
The engine of a resumed session starts reading its part of the snapshot at once
(:func:`hora.engines.park.start_prefetch`).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable

from hora.env import RankEnv
from hora.procs import signal_group

_STACK_FILES: list[object] = []


def _watch_parent(parent: int, cleanup: str | None) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            if cleanup:  # the kernel died before it could remove the cluster's directory
                shutil.rmtree(cleanup, ignore_errors=True)
            # this process leads its own process group (started with a new session): take the
            # whole group down, including processes it forked (the controller's heart monitor,
            # DataLoader workers of an engine), which have no watchdog of their own
            try:
                signal_group(0, signal.SIGKILL)
            finally:
                os._exit(1)


def _watch_controller(controller: int) -> None:
    while os.getppid() == controller:
        time.sleep(0.5)
    os._exit(1)  # this process only: its group may hold others that outlive the controller


def _watch_in_fork() -> None:
    # the controller forks its heart monitor into its own group: killed with SIGKILL, the
    # controller runs no watchdog, and the fork would live on alone; it watches the controller
    threading.Thread(
        target=_watch_controller, args=(os.getppid(),), name="hora-watchdog", daemon=True
    ).start()


def _engine(args: list[str]) -> None:
    stack = [a for a in args if a.startswith("--stack-file=")]
    rest = [a for a in args if not a.startswith("--stack-file=")]
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if stack:
        fh = open(stack[0].split("=", 1)[1], "a")  # noqa: SIM115 - kept open for the handler
        _STACK_FILES.append(fh)
        faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True)
    from hora.engines import bootstrap

    bootstrap.start_background_init()
    from hora.engines import outputs

    outputs.count_outputs()  # each reply says how many outputs the cell published
    # engines are not debugged through the notebook's debugger; skipping debugpy saves startup
    sys.modules.setdefault("debugpy", None)  # type: ignore[arg-type]
    from ipyparallel.engine.app import main

    sys.argv = ["ipengine", *rest]
    main()


CONNECTION_VAR = RankEnv.var("engine_connection")


def _remove_on_stop(home: str) -> None:
    """Remove ``home`` (it holds the controller's key) when the service stops the engine.

    The service stops a session with SIGTERM (SIGKILL after its grace period): until
    ipyparallel installs its own handler (which ends the engine through ``atexit``), a SIGTERM
    removes the directory, then ends the engine by the same signal.
    """

    def stop(signum: int, frame: object) -> None:
        shutil.rmtree(home, ignore_errors=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, stop)


def _forget_after_load(engine_cls: type, url: str) -> None:
    """Remove the connection file ``url`` as soon as ipyparallel's engine has read it.

    ipyparallel reads it once, at start; from then on the controller's key lives only in this
    process, so an engine that dies without running its handlers (``os._exit``, SIGKILL, a
    crash) leaves no key on the node's disk.
    """
    load = engine_cls.load_connection_file  # type: ignore[attr-defined]

    def load_then_forget(self: object) -> None:
        try:
            load(self)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(url)

    engine_cls.load_connection_file = load_then_forget  # type: ignore[attr-defined]


def _session_engine() -> None:
    """An engine of a service session: connect with the info the service passed (see above)."""
    info = json.loads(os.environ.pop(CONNECTION_VAR))  # not inherited by the user's children
    from hora.engines import park

    park.start_prefetch()  # a resumed session's engine reads its part while it starts
    home = tempfile.mkdtemp(prefix="hora-session-engine-")  # mode 0700: the key stays ours
    atexit.register(shutil.rmtree, home, True)
    _remove_on_stop(home)
    url = os.path.join(home, "engine.json")
    with open(os.open(url, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump(info, f)
    from ipyparallel.engine.app import IPEngine

    _forget_after_load(IPEngine, url)
    from hora.engines import bootstrap

    stack = os.path.join(home, "stack.txt")
    open(stack, "w").close()
    bootstrap.STACK_FILE[:] = [stack]
    bootstrap.serve_stacks()  # the kernel may be on another machine: it asks for stacks
    _engine(
        [
            f"--stack-file={stack}",
            f"--profile-dir={home}",
            "--log-level=WARN",
            f"--IPEngine.url_file={url}",
            "--IPEngine.enable_nanny=False",
        ]
    )


def _or_end_the_controller(start: Callable[..., None]) -> Callable[..., None]:
    """The heart monitor's entry, which ends the controller when the monitor fails.

    It runs in the process the controller forks, and fails on a port it cannot bind. Left
    alone, the controller runs on without a heartbeat: engines register, never hear a beat,
    and give up only after their own 50 missed beats, with a log that does not say why. Ended,
    the controller's exit and its log (this traceback) say why at once.
    """

    def run(*args: object, **kwargs: object) -> None:
        try:
            start(*args, **kwargs)
        except Exception:
            traceback.print_exc()
            sys.stderr.write("hora: the controller's heart monitor failed; ending the controller\n")
            sys.stderr.flush()
            os.kill(os.getppid(), signal.SIGTERM)
            os._exit(1)

    return run


def _controller(args: list[str]) -> None:
    from ipyparallel.controller import app

    start = app.start_heartmonitor  # type: ignore[attr-defined]
    app.start_heartmonitor = _or_end_the_controller(start)  # type: ignore[attr-defined]
    sys.argv = ["ipcontroller", *args]
    app.main()


def run(argv: list[str]) -> None:
    """Run the controller or an engine (``argv[0]``), exiting if the parent process dies."""
    profile = [a.split("=", 1)[1] for a in argv if a.startswith("--profile-dir=")]
    cleanup = profile[0] if argv[:1] == ["controller"] and profile else None
    threading.Thread(
        target=_watch_parent, args=(os.getppid(), cleanup), name="hora-watchdog", daemon=True
    ).start()
    if argv[:1] == ["controller"]:
        os.register_at_fork(after_in_child=_watch_in_fork)
    if argv[:1] == ["engine"]:
        _engine(argv[1:])
    elif argv[:1] == ["session-engine"]:
        _session_engine()
    elif argv[:1] == ["controller"]:
        _controller(argv[1:])
    else:
        sys.exit(
            "usage: python -m hora.engines._child controller|engine|session-engine [args]; "
            f"got {argv[:1]}"
        )


if __name__ == "__main__":
    run(sys.argv[1:])
