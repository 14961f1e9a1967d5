"""Small network helpers shared by the service, the engines and the launcher (data plane)."""

from __future__ import annotations

import errno
import random
import socket
import threading
import time

__all__ = ["PortHold", "free_port", "hold_ports", "is_local_address", "route_source"]


_LISTEN_PORTS_LOW = 20000  # hora's rendezvous ports come from [20000, the OS's ephemeral range)


_PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"

# A port is bound seconds after it is drawn (a controller binds its heart monitor's last, a
# job's rank 0 after importing torch). Until then another draw, in this process or in any
# other on the machine (the service, a second notebook, another user's kernel), could return
# it again, and one of the two binds would fail. So each draw also claims its port for
# _HOLD_S by binding an abstract Unix socket named after it: the name is machine-wide (per
# network namespace, like the port itself), needs no file or permission, and goes with the
# process that holds it. A draw skips a port whose name is taken. At most _CLAIMS_MAX are
# kept; the oldest (bound long since) go first.
_HOLD_S = 300.0
_CLAIMS_MAX = 256
_CLAIM_PREFIX = "\0hora.net.port."
_CLAIMS: dict[int, tuple[float, socket.socket]] = {}
_CLAIMS_LOCK = threading.Lock()


def _claim(port: int) -> bool:
    """Claim ``port`` machine-wide for ``_HOLD_S``; False if a draw anywhere claimed it.

    Where no claim can be made (no descriptor left, Unix sockets refused), True: the probe
    alone decides, as before claims existed.
    """
    now = time.monotonic()
    with _CLAIMS_LOCK:
        while _CLAIMS:  # in the order made, so the oldest first: expired, or over the cap
            oldest = next(iter(_CLAIMS))
            if len(_CLAIMS) < _CLAIMS_MAX and now - _CLAIMS[oldest][0] <= _HOLD_S:
                break
            _CLAIMS.pop(oldest)[1].close()
        try:
            name = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:
            return True
        try:
            name.bind(f"{_CLAIM_PREFIX}{port}")
        except OSError as e:
            name.close()
            return e.errno != errno.EADDRINUSE  # in use: claimed by a draw here or elsewhere
        _CLAIMS[port] = (now, name)
        return True


def _unclaim(port: int) -> None:
    """Give a claim back (its probe failed: the port is not handed out)."""
    with _CLAIMS_LOCK:
        held = _CLAIMS.pop(port, None)
    if held is not None:
        held[1].close()


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
    OS picks, as ``bind(0)`` does, lies in that range, where any of them may). A port any
    process on the machine drew in the last five minutes, while that process lives, is not
    handed out again (it may not be bound yet): each draw claims its port under an abstract
    Unix socket name. With no such range (a machine configured otherwise) the OS picks one.

    Args:
        host: the address to probe.

    Returns:
        A port number free right now (another process may still take it later; the
        rendezvous then fails with a clear error instead of hanging).

    Example:
        >>> 0 < free_port() < 65536
        True
    """
    with _drawn(host) as s:
        return int(s.getsockname()[1])


def _drawn(host: str) -> socket.socket:
    """A socket bound (plainly) to a port drawn as :func:`free_port` says; the caller closes it.

    A plain bind is the probe: it fails on a port any process listens on or holds
    (:class:`PortHold`); a port another draw claimed lately (:func:`_claim`) is not probed.
    """
    low = _ephemeral_low()
    if low - _LISTEN_PORTS_LOW >= 1000:
        for _ in range(64):
            port = random.randrange(_LISTEN_PORTS_LOW, low)
            if not _claim(port):
                continue
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                _unclaim(port)
                continue
            return s
    s = socket.socket()
    try:
        s.bind((host, 0))
    except BaseException:
        s.close()
        raise
    return s


class PortHold:
    """Ports kept bound here, not listening, until a process started later binds them.

    Each socket has ``SO_REUSEADDR`` and does not listen, so the process the ports are for
    (a controller: ZeroMQ binds with ``SO_REUSEADDR``) binds and listens on them at once,
    while :func:`free_port`, in this process or any other (a second notebook, the service,
    another user's kernel), fails its probe on them and draws another: two of hora's draws
    on one machine never give the same port while it is held. Release it once the ports are
    bound (a held port is otherwise lost to the machine's other hora processes).
    """

    def __init__(self, sockets: list[socket.socket]) -> None:
        self._sockets = sockets
        self.ports: list[int] = [int(s.getsockname()[1]) for s in sockets]

    def release(self) -> None:
        """Close the placeholders (harmless twice)."""
        for s in self._sockets:
            s.close()
        self._sockets = []


def hold_ports(n: int, host: str = "127.0.0.1") -> PortHold:
    """Return ``n`` distinct ports, held (:class:`PortHold`) until released.

    Each is drawn as :func:`free_port` draws one, and the probe's own socket is kept, given
    ``SO_REUSEADDR`` once bound (see :class:`PortHold`); the ports differ from each other and
    from every port a live process on the machine drew lately, whatever ``host`` each was
    held on.

    Example:
        >>> hold = hold_ports(2)
        >>> probe = socket.socket()
        >>> probe.bind(("127.0.0.1", hold.ports[0]))
        Traceback (most recent call last):
        OSError: [Errno 98] Address already in use
        >>> probe.close(); hold.release()
    """
    held: list[socket.socket] = []
    try:
        while len(held) < n:
            held.append(_drawn(host))
            held[-1].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    except BaseException:
        for s in held:
            s.close()
        raise
    return PortHold(held)


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
