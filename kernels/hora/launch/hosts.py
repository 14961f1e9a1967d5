"""Hosts of an elastic ``hora run``: the discovery script's output and the blacklist (pure).

Data plane, standard library only. A host discovery script prints one ``host:slots`` (or
``host``, one slot) per line, as Horovod's does; :func:`parse_hosts_output` reads it.
:class:`Blacklist` keeps hosts whose workers keep failing out for a cool-down that doubles
each time the host is blacklisted again (Horovod's ``--blacklist-cooldown-range``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from hora.errors import SpecError

DISCOVERY_TIMEOUT_S = 10.0


def parse_hosts_output(text: str) -> dict[str, int]:
    r"""Return ``{host: slots}`` from a discovery script's output (blank lines and # ignored).

    Raises:
        SpecError: for a line that is not ``host`` or ``host:slots`` with slots >= 0.

    Example:
        >>> parse_hosts_output("localhost:2\nnode7\n")
        {'localhost': 2, 'node7': 1}
    """
    hosts: dict[str, int] = {}
    for line in text.splitlines():
        item = line.split("#", 1)[0].strip()
        if not item:
            continue
        name, sep, raw = item.rpartition(":") if ":" in item else (item, "", "1")
        if not name or not raw.isdigit():
            raise SpecError("--host-discovery-script", f"line {line!r} is not host:slots")
        hosts[name] = hosts.get(name, 0) + int(raw)
    return hosts


def discover(argv: Sequence[str], timeout_s: float = DISCOVERY_TIMEOUT_S) -> dict[str, int]:
    """Run the discovery script (an argument list, never a shell) and parse its output.

    Raises:
        SpecError: when it fails, times out or prints something else than hosts.
    """
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SpecError("--host-discovery-script", f"{argv[0]!r} did not run: {e}") from None
    if res.returncode != 0:
        raise SpecError("--host-discovery-script",
                        f"{argv[0]!r} exited with {res.returncode}: {res.stderr.strip()[-300:]}")
    return parse_hosts_output(res.stdout)


@dataclass
class Blacklist:
    """Hosts kept out after repeated failures, each for a cool-down that doubles.

    A host is blacklisted when ``threshold`` of its workers failed within ``window_s``; it
    comes back after ``low * 2**(n-1)`` seconds (at most ``high``) the n-th time.

    Example:
        >>> b = Blacklist(threshold=2, low=10, high=60)
        >>> b.failed("h", 0.0), b.failed("h", 1.0), b.blocked("h", 5.0), b.blocked("h", 11.5)
        (False, True, True, False)
    """

    threshold: int = 3
    window_s: float = 60.0
    low: float = 10.0
    high: float = 300.0
    _failures: dict[str, list[float]] = field(default_factory=dict)
    _times: dict[str, int] = field(default_factory=dict)
    _until: dict[str, float] = field(default_factory=dict)

    def failed(self, host: str, now: float) -> bool:
        """Count a failed worker on ``host``; return whether the host is blacklisted now."""
        recent = [t for t in self._failures.get(host, []) if now - t < self.window_s] + [now]
        self._failures[host] = recent
        if len(recent) < self.threshold:
            return False
        n = self._times[host] = self._times.get(host, 0) + 1
        self._until[host] = now + min(self.high, self.low * 2 ** (n - 1))
        self._failures[host] = []
        return True

    def blocked(self, host: str, now: float) -> bool:
        """Return whether ``host`` is cooling down at ``now``."""
        return now < self._until.get(host, 0.0)
