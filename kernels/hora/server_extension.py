"""A Jupyter server extension: SIGINT stops the server cleanly, kernels first (data plane).

JupyterHub stops a user's server (its idle culler, the admin, a hub shutdown) by sending it
SIGINT, then SIGTERM 30 s later. Jupyter Server shuts its kernels down cleanly on SIGTERM,
but on SIGINT only at a terminal (where it asks first); elsewhere SIGINT ends its event loop
and the process, and each kernel, seeing its parent gone, exits at once with ``os._exit``:
nothing registered with ``atexit`` runs, so hora's kernel cannot end (or park) its session
and the service frees the slots only when the session's lease runs out.

Loaded in a server that has no terminal, this extension makes SIGINT do what SIGTERM does:
the server shuts every kernel down (a ``shutdown_request``, ``KernelManager.
shutdown_wait_time`` to exit), then stops. ``hora_service.hub.configure`` enables it in the
users' servers (``--ServerApp.jpserver_extensions``); it does nothing at a terminal.
"""

from __future__ import annotations

import signal
import sys
from typing import Any


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "hora.server_extension"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    if sys.stdin is not None and sys.stdin.isatty():
        return  # Ctrl-C at a terminal: Jupyter Server asks before it stops

    def stop(signum: int, frame: object) -> None:
        serverapp.log.info("SIGINT: shutting the kernels down, then the server (hora)")
        serverapp.stop(from_signal=True)

    signal.signal(signal.SIGINT, stop)
