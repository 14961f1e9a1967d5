"""Small network helpers shared by the service, the engines and the launcher (data plane)."""

from __future__ import annotations

import random
import socket
from collections.abc import Collection

__all__ = ["free_port", "free_ports", "is_local_address", "route_source"]


_LISTEN_PORTS_LOW = 20000  # hora's rendezvous ports come from [20000, the OS's ephemeral range)


_PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low(path: str = _PORT_RANGE) -> int:
    """The first port of the OS's ephemeral range; Linux's default where it cannot be read."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now, outside the ephemeral range.

    The port is drawn at random below the OS's ephemeral range (from 20000 up to
    ``ip_local_port_range``'s first port), so the outgoing connections of other processes
    never take it between this choice and the bind that follows seconds later (a port the
    OS picks, as ``bind(0)`` does, lies in that range, where any of them may). With no such
    range (a machine configured otherwise) the OS picks one.

    Args:
        host: the address to probe.

    Returns:
        A port number free right now (another process may still take it later; the
        rendezvous then fails with a clear error instead of hanging).

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    low = _ephemeral_low()
    if low - _LISTEN_PORTS_LOW >= 1000:
        for _ in range(64):
            port = random.randrange(_LISTEN_PORTS_LOW, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1", besides: Collection[int] = ()) -> list[int]:
    """Return ``n`` distinct ports, each as :func:`free_port` chooses, none of ``besides``.

    Example:
        >>> ports = free_ports(3)
        >>> len(set(ports)), set(free_ports(2, besides=ports)) & set(ports)
        (3, set())
    """
    ports: dict[int, None] = {}
    while len(ports) < n:
        if (port := free_port(host)) not in besides:
            ports[port] = None
    return list(ports)


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
