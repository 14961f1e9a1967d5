"""The one GPU inventory of hora: what this machine has, for the service and the engines.

Data plane (importable by both planes; no torch, no CUDA in this process). The service
schedules :func:`inventory`; a notebook kernel hands the GPUs of :func:`visible_gpus` to its
engines. Both find GPUs the same way: ``nvidia-smi``, or, where it is not installed but
NVIDIA devices exist, torch in a child process.

``--gpus auto`` asks ``nvidia-smi`` (an argument list, with a timeout), or, where it is not
installed but NVIDIA devices exist, torch in a child process (so that the service itself never
holds a CUDA context); a count or a list names the GPUs by hand. With no GPU at all,
``cpu_slots`` slots of kind ``cpu`` stand in so that jobs run on CPU with gloo.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hora.kinds import SlotKind

log = logging.getLogger(__name__)

NVIDIA_SMI_TIMEOUT_S = 10.0
TORCH_PROBE_TIMEOUT_S = 60.0
TORCH_PROBE = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


@dataclass(frozen=True)
class Slot:
    """One schedulable unit: a GPU (by its index) or a CPU slot."""

    index: int
    kind: SlotKind
    name: str


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the kernel sees it without touching CUDA (from nvidia-smi).

    Attributes:
        id: the id to put in an engine's ``CUDA_VISIBLE_DEVICES`` (index or UUID).
        busy_pids: processes that hold a CUDA context on it.
        index: its index on this machine (``nvidia-smi``'s), which names its lease; None:
            ``id`` is the index.
        holder: who holds its machine-wide lease (:mod:`hora.leases`), in words; None: free.
    """

    id: str
    busy_pids: tuple[int, ...] = ()
    index: int | None = None
    holder: str | None = None

    @property
    def lease(self) -> str:
        """The name of its lease (``gpu<index>``).

        Example:
            >>> GpuInfo("GPU-aaaa", index=3).lease, GpuInfo("1").lease
            ('gpu3', 'gpu1')
        """
        return f"gpu{self.index if self.index is not None else self.id}"


def parse_gpu_apps(gpus_csv: str, apps_csv: str, cuda_visible: str | None) -> list[GpuInfo]:
    """Read ``nvidia-smi`` CSV output into the GPUs this kernel may use.

    Args:
        gpus_csv: output of ``nvidia-smi --query-gpu=index,uuid --format=csv,noheader``.
        apps_csv: output of ``nvidia-smi --query-compute-apps=gpu_uuid,pid --format=csv,noheader``.
        cuda_visible: the kernel's ``CUDA_VISIBLE_DEVICES`` (restricts and orders), or None.

    Returns:
        The visible GPUs, each with the pids that use it.

    Example:
        >>> parse_gpu_apps("0, GPU-a", "GPU-a, 42", "0")
        [GpuInfo(id='0', busy_pids=(42,), index=0, holder=None)]
    """
    rows = [[c.strip() for c in line.split(",")] for line in gpus_csv.splitlines() if line.strip()]
    busy: dict[str, list[int]] = {}
    for line in apps_csv.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) >= 2 and cols[1].isdigit():
            busy.setdefault(cols[0], []).append(int(cols[1]))
    by_key = {key: (idx, uuid) for idx, uuid in rows for key in (idx, uuid)}
    if cuda_visible is None:
        chosen = [idx for idx, _ in rows]
    else:
        chosen = [v.strip() for v in cuda_visible.split(",") if v.strip() and v.strip() in by_key]
    return [
        GpuInfo(v, tuple(busy.get(by_key[v][1], ())), int(by_key[v][0]) if by_key[v][0].isdigit()
                else None)
        for v in chosen
    ]  # fmt: skip


def parse_nvidia_smi(text: str) -> list[Slot]:
    r"""GPUs from ``nvidia-smi --query-gpu=index,name --format=csv,noheader``.

    Example:
        >>> [s.name for s in parse_nvidia_smi("0, NVIDIA H100\n1, NVIDIA H100\n")]
        ['NVIDIA H100', 'NVIDIA H100']
    """
    slots = []
    for line in text.splitlines():
        index, _, name = line.partition(",")
        if index.strip().isdigit():
            slots.append(Slot(int(index), SlotKind.gpu, name.strip() or f"gpu{index.strip()}"))
    return slots


def detect_gpus(python: str = sys.executable, dev: Path = Path("/dev")) -> list[Slot]:
    """The GPUs ``nvidia-smi`` reports, else torch's count; none when neither can tell."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return torch_gpus(python) if any(dev.glob("nvidia[0-9]*")) else []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("nvidia-smi failed (%s); scheduling CPU slots", e)
        return []
    return parse_nvidia_smi(out)


def torch_gpus(python: str = sys.executable) -> list[Slot]:
    """The CUDA devices torch sees, asked in a child process (with a timeout)."""
    try:
        out = subprocess.run(
            [python, "-c", TORCH_PROBE],
            capture_output=True,
            text=True,
            timeout=TORCH_PROBE_TIMEOUT_S,
            check=True,
        ).stdout
        count = int(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        log.warning("could not count GPUs with torch (%s); scheduling CPU slots", e)
        return []
    return [Slot(i, SlotKind.gpu, f"cuda:{i}") for i in range(count)]


def inventory(gpus: str, cpu_slots: int) -> list[Slot]:
    """The slots to schedule for a ``--gpus`` value (see the module docstring).

    Example:
        >>> [s.name for s in inventory("0", 2)]
        ['cpu0', 'cpu1']
        >>> [s.index for s in inventory("1,3", 2)]
        [1, 3]
    """
    if gpus == "auto":
        found = detect_gpus()
    elif gpus.isdigit():
        found = [Slot(i, SlotKind.gpu, f"gpu{i}") for i in range(int(gpus))]
    else:
        found = [Slot(int(i), SlotKind.gpu, f"gpu{i}") for i in gpus.split(",")]
    return found or [Slot(i, SlotKind.cpu, f"cpu{i}") for i in range(cpu_slots)]


def visible_gpus(
    environ: Mapping[str, str] | None = None,
    dev: Path = Path("/dev"),
    python: str = sys.executable,
) -> list[GpuInfo]:
    """The GPUs a notebook kernel may hand to engines, with the pids using them.

    ``nvidia-smi`` when installed (ids and busy pids); else, where NVIDIA devices exist, the
    count torch sees in a child process (busy pids unknown); else none. ``CUDA_VISIBLE_DEVICES``
    restricts and orders them; an empty value means none.

    Args:
        environ: the kernel's environment (default ``os.environ``).
        dev: where device nodes live (tests point it elsewhere).
        python: the interpreter that asks torch (tests pass a stand-in).

    Returns:
        The visible GPUs.
    """
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible == "":
        return []
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if smi is None:
        found = torch_gpus(python) if any(dev.glob("nvidia[0-9]*")) else []
        ids = [str(s.index) for s in found]
        if visible is not None:
            ids = [v.strip() for v in visible.split(",") if v.strip() in ids]
        return [GpuInfo(i) for i in ids]
    try:
        gpus = _smi([smi, "--query-gpu=index,uuid", "--format=csv,noheader"], check=True)
        apps = _smi([smi, "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"])
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("nvidia-smi failed (%s); starting CPU engines", e)
        return []
    return parse_gpu_apps(gpus, apps, visible)


def _smi(argv: list[str], check: bool = False) -> str:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=check
    ).stdout
