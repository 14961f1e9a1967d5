"""The elastic rendezvous: how ``hora run``'s elastic driver and its workers agree on a world.

Data plane, standard library only (the driver imports no torch). The driver and the workers
share one private directory (``HORA_ELASTIC_DIR``, mode 0700, made by the driver):

* ``world.json`` is written by the driver only (atomically): the current *generation*: its
  number, the members in rank order (worker ids with their host numbers), the address and a
  fresh port for that generation's store, and whether it is ready (``ready`` is False while
  the driver waits for capacity: fewer live workers than ``--min-np``);
* ``hello.<wid>``: a worker reached its first ``hvd.init()`` (the driver adds it to the next
  generation only then, so a starting replacement never holds the others up);
* ``arrived.<gen>.<wid>``: a member reached that generation's rendezvous (the barrier every
  member passes before the process group is made, so a member that died in between is seen
  as a new generation instead of a rendezvous timeout);
* ``reset.<wid>``: a member left generation N after a failed collective and asks for a new one
  (the driver publishes N+1 if N is still current: a failure that killed nobody);
* ``removed.<wid>``: the driver took this worker out (its host or slot went away); it exits 0.

Worker ids are ``w0``, ``w1``, ... in start order and never reused.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_TIMEOUT_S = 600.0
WORLD_FILE = "world.json"


@dataclass(frozen=True)
class Member:
    """One worker's place in a generation.

    Attributes:
        wid: the worker id (``w3``).
        host: the host name its slot is on.
        local_rank: its index among the generation's members on that host.
        local_size: the generation's members on that host.
        cross_rank: the host's index among the generation's hosts.
        cross_size: the number of hosts in the generation.
    """

    wid: str
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


@dataclass(frozen=True)
class Generation:
    """One world of an elastic job, as the driver published it.

    Attributes:
        number: 1, 2, ... (a new one after every membership change).
        members: the members in rank order (rank 0 first).
        addr: the rendezvous address.
        port: the rendezvous port of this generation (rank 0 hosts the store there).
        ready: False while the driver waits for capacity (the members list is then empty).
        note: why this generation was made (for logs).
    """

    number: int
    members: tuple[Member, ...]
    addr: str
    port: int
    ready: bool = True
    note: str = ""

    def rank_of(self, wid: str) -> int | None:
        """Return the rank of worker ``wid`` in this generation, or None when not a member.

        Example:
            >>> g = Generation(1, (Member("w0", "localhost", 0, 1, 0, 1),), "127.0.0.1", 1)
            >>> g.rank_of("w0"), g.rank_of("w1")
            (0, None)
        """
        for rank, m in enumerate(self.members):
            if m.wid == wid:
                return rank
        return None


def members_for(order: list[tuple[str, str]]) -> tuple[Member, ...]:
    """Number the workers ``[(wid, host), ...]`` (rank order) by host.

    Example:
        >>> [m.local_rank for m in members_for([("w0", "a"), ("w2", "b"), ("w3", "a")])]
        [0, 0, 1]
    """
    hosts = list(dict.fromkeys(host for _, host in order))
    out = []
    for wid, host in order:
        same = [w for w, h in order if h == host]
        out.append(Member(wid, host, same.index(wid), len(same), hosts.index(host), len(hosts)))
    return tuple(out)


def write_generation(root: Path, gen: Generation) -> None:
    """Publish ``gen`` as the current generation (atomic: readers see the old or the new)."""
    tmp = root / f".{WORLD_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(gen)))
    os.replace(tmp, root / WORLD_FILE)


def read_generation(root: Path) -> Generation | None:
    """Return the current generation, or None before the driver published one."""
    try:
        raw = json.loads((root / WORLD_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    members = tuple(Member(**m) for m in raw.pop("members"))
    return Generation(members=members, **raw)


def mark(root: Path, name: str, text: str = "") -> None:
    """Create (or overwrite) the marker file ``name`` (``hello.w3``, ``arrived.4.w3``...)."""
    tmp = root / f".{name}.{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, root / name)


def has(root: Path, name: str) -> bool:
    """Return whether the marker ``name`` exists."""
    return (root / name).exists()


def missing_arrivals(root: Path, gen: Generation) -> list[int]:
    """Return the ranks of ``gen`` that have not reached its rendezvous yet."""
    return [r for r, m in enumerate(gen.members) if not has(root, f"arrived.{gen.number}.{m.wid}")]


def reset_requests(root: Path) -> dict[str, int]:
    """Return the workers that asked for a new generation, with the generation they left."""
    out = {}
    for path in root.glob("reset.*"):
        try:
            out[path.name.removeprefix("reset.")] = int(path.read_text() or 0)
        except (OSError, ValueError):
            continue
    return out


MEMBERSHIP_TAG = "membership "


def membership_line(gen: Generation, pids: dict[str, int], at: float) -> str:
    """One generation as the line ``--report-membership`` prints (after ``hora run: ``).

    Example:
        >>> g = Generation(2, members_for([("w0", "localhost")]), "127.0.0.1", 1, note="start")
        >>> membership_line(g, {"w0": 7}, 0.0)[:45]
        'membership {"generation": 2, "size": 1, "reas'
    """
    members = [[m.wid, pids.get(m.wid, 0)] for m in gen.members]
    body = {"generation": gen.number, "size": len(gen.members), "reason": gen.note, "at": at,
            "members": members}  # fmt: skip
    return MEMBERSHIP_TAG + json.dumps(body)


def read_membership(line: str) -> dict[str, object] | None:
    """The generation a ``membership`` line reports, or None for any other line.

    Example:
        >>> read_membership('hora run: membership {"generation": 2, "size": 1}')["size"]
        1
        >>> read_membership("[0]<stdout>:membership {}") is None
        True
    """
    head, sep, body = line.partition(MEMBERSHIP_TAG)
    if not sep or head not in ("", "hora run: "):
        return None
    try:
        found = json.loads(body)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None
