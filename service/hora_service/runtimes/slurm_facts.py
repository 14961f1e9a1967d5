r"""What a Slurm partition offers a job, from what Slurm reports (control plane, pure).

The slurm runtime asks ``scontrol show partition -o`` and ``scontrol show node -o`` (cached,
:meth:`hora_service.runtimes.slurm.SlurmRuntime.partition`) and :func:`parse_partition` reads
them: the partition's nodes, the most a job may span (``MaxNodes``), and what the smallest
of its nodes holds: GPUs (its ``Gres``) and CPUs (``CPUEfctv``, else ``CPUTot``). From that
come the slots a node gives a job (GPUs, or CPU ranks on a partition without GPUs) unless the
admin sets ``slurm_slots_per_node``, and the jobs a partition can never hold, refused at
submission. :func:`gpu_holders` reads who holds each of the nodes' GPUs (``/v1/gpus``).

Example:
    >>> parts = "PartitionName=debug Default=YES MaxNodes=UNLIMITED Nodes=n[1-2] TotalNodes=2"
    >>> nodes = ("NodeName=n1 CPUTot=4 Gres=gpu:2 Partitions=debug\n"
    ...          "NodeName=n2 CPUTot=4 Gres=gpu:2 Partitions=debug")
    >>> p = parse_partition(parts, nodes, None)
    >>> p, p.slots_per_node(gpus=True), p.slots_per_node(gpus=False)
    (Partition(name='debug', nodes=2, gpus=2, cpus=4), 2, 4)
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hora.kinds import SlotKind

from hora_service.models import SlotInfo

_GRES_DETAIL = re.compile(r"Nodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=(\S+)")


@dataclass(frozen=True)
class Partition:
    """A partition as a job sees it.

    Attributes:
        name: the partition's name.
        nodes: the most nodes one job may span (its nodes, or fewer with ``MaxNodes``).
        gpus: GPUs of its smallest node (0: no GPU on some node).
        cpus: CPUs of its smallest node.
    """

    name: str
    nodes: int
    gpus: int
    cpus: int

    def slots_per_node(self, gpus: bool) -> int:
        """Slots one node gives a job: its GPUs (``gpus``), else its CPUs (one rank each)."""
        return self.gpus if gpus else self.cpus


def fields(line: str) -> dict[str, str]:
    """``Key=value`` pairs of one line of ``scontrol show ... -o``.

    Example:
        >>> fields("NodeName=n1 CPUTot=4")["CPUTot"]
        '4'
    """
    return dict(p.split("=", 1) for p in line.split() if "=" in p)


def gpu_count(gres: str) -> int:
    """GPUs in a node's ``Gres=`` (``gpu:2``, ``gpu:a100:4(S:0)``); 0 without any.

    Example:
        >>> gpu_count("gpu:a100:4(S:0),tmpdisk:100"), gpu_count("(null)")
        (4, 0)
    """
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def expand_hosts(nodelist: str) -> list[str]:
    """Slurm's host list syntax, expanded.

    Example:
        >>> expand_hosts("n[1-2],gpu[03-04,07],login")
        ['n1', 'n2', 'gpu03', 'gpu04', 'gpu07', 'login']
    """
    out: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            out.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            out += [f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return out


def parse_partition(partitions: str, nodes: str, wanted: str | None) -> Partition:
    """The partition ``wanted`` (None: the cluster's default) from ``scontrol``'s answers.

    Args:
        partitions: ``scontrol show partition -o``.
        nodes: ``scontrol show node -o``.
        wanted: the admin's ``slurm_partition`` (a comma list: the first is read).

    Raises:
        ValueError: no such partition, no default one, or it has no node (the message says).
    """
    rows = [fields(line) for line in partitions.splitlines() if "PartitionName=" in line]
    name = (wanted or "").split(",")[0]
    found = next((r for r in rows if r["PartitionName"] == name), None) if name else next(
        (r for r in rows if r.get("Default") == "YES"), None
    )
    if found is None:
        known = ", ".join(r["PartitionName"] for r in rows) or "none"
        what = f"no partition {name!r}" if name else "no default partition"
        raise ValueError(f"Slurm has {what} (its partitions: {known})")
    members = set(expand_hosts(found.get("Nodes", "")))
    mine = [f for f in map(fields, nodes.splitlines()) if f.get("NodeName") in members]
    if not mine:
        raise ValueError(f"partition {found['PartitionName']!r} has no node")
    limit = found.get("MaxNodes", "UNLIMITED")
    most = min(len(mine), int(limit)) if limit.isdigit() else len(mine)
    cpus = [int(n.get("CPUEfctv") or n.get("CPUTot") or 0) for n in mine]
    return Partition(
        found["PartitionName"], most, min(gpu_count(n.get("Gres", "")) for n in mine), min(cpus)
    )


def _indices(gres: str) -> list[int]:
    """GPU indices of a job's ``GRES=gpu:2(IDX:0-1)`` detail.

    Example:
        >>> _indices("gpu:2(IDX:0-1)"), _indices("gpu:3(IDX:0,2-3)")
        ([0, 1], [0, 2, 3])
    """
    m = re.search(r"IDX:([0-9,-]+)", gres)
    if m is None or not gres.startswith("gpu"):
        return []
    out: list[int] = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def gpu_holders(
    nodes: Sequence[str], jobs: Sequence[str], hora: Mapping[str, tuple[int, str, str]]
) -> list[SlotInfo]:
    """Each GPU of the nodes and its holder.

    Args:
        nodes: the lines of ``scontrol show node -o``.
        jobs: the lines of ``scontrol show job -d -o`` (running jobs' GPU indices).
        hora: Slurm job id -> (hora job, user, kind) of this service's jobs.
    """
    held: dict[tuple[str, int], tuple[str, str]] = {}
    for line in jobs:
        f = fields(line)
        if f.get("JobState") != "RUNNING":
            continue
        user = f.get("UserId", "").split("(")[0]
        for hosts, gres in _GRES_DETAIL.findall(line):
            for host in expand_hosts(hosts):
                for i in _indices(gres):
                    held[(host, i)] = (f.get("JobId", ""), user)
    out = []
    for line in nodes:
        f = fields(line)
        name = f.get("NodeName", "")
        for i in range(gpu_count(f.get("Gres", ""))):
            job, user = held.get((name, i), ("", ""))
            mine = hora.get(job)
            out.append(SlotInfo(
                index=i, kind=SlotKind.gpu, name=f"{name}:gpu{i}", node=name,
                slurm_job=job or None,
                job_id=mine[0] if mine else None,
                user=mine[1] if mine else (user or None),
                holder_kind=mine[2] if mine else ("slurm" if job else None),
            ))  # fmt: skip
    return out


def node_addresses(scontrol_nodes: str) -> set[str]:
    """The IPv4 addresses of the nodes ``scontrol show node -o`` lists (those that resolve)."""
    found = set()
    for node in map(fields, scontrol_nodes.splitlines()):
        name = node.get("NodeAddr") or node.get("NodeName")
        if not name:
            continue
        with contextlib.suppress(OSError):
            found.add(socket.gethostbyname(name))
    return found
