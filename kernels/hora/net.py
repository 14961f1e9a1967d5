"""Small network helpers shared by the service, the engines and the launcher (data plane)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now.

    Args:
        host: the address to probe.

    Returns:
        A port number the OS just handed out (another process may take it later; the
        rendezvous then fails with a clear error instead of hanging).

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
