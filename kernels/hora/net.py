"""Small network helpers shared by the service, the engines and the launcher (data plane)."""

from __future__ import annotations

import socket

__all__ = ["free_port", "is_local_address", "route_source"]


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


def is_local_address(host: str) -> bool:
    """Whether ``host`` is an address of this machine (binding it succeeds).

    Example:
        >>> is_local_address("127.0.0.1"), is_local_address("198.51.100.7")
        (True, False)
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))
    except OSError:
        return False
    return True


def route_source(host: str) -> str:
    """The address of this machine that reaches ``host`` (a route is chosen; nothing is sent).

    Raises:
        OSError: ``host`` cannot be resolved or routed to.

    Example:
        >>> route_source("127.0.0.1")
        '127.0.0.1'
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))  # UDP: picks the route, sends nothing
        return str(s.getsockname()[0])
