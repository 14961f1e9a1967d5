"""What this machine can schedule: its GPUs, or CPU slots where it has none (control plane).

``--gpus auto`` asks ``nvidia-smi`` (an argument list, with a timeout), or, where it is not
installed but NVIDIA devices exist, torch in a child process (so that the service itself never
holds a CUDA context); a count or a list names the GPUs by hand. With no GPU at all,
``cpu_slots`` slots of kind ``cpu`` stand in so that jobs run on CPU with gloo.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

NVIDIA_SMI_TIMEOUT_S = 10.0
TORCH_PROBE_TIMEOUT_S = 60.0
TORCH_PROBE = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


@dataclass(frozen=True)
class Slot:
    """One schedulable unit: a GPU (by its index) or a CPU slot."""

    index: int
    kind: str
    name: str


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
            slots.append(Slot(int(index), "gpu", name.strip() or f"gpu{index.strip()}"))
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
    return [Slot(i, "gpu", f"cuda:{i}") for i in range(count)]


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
        found = [Slot(i, "gpu", f"gpu{i}") for i in range(int(gpus))]
    else:
        found = [Slot(int(i), "gpu", f"gpu{i}") for i in gpus.split(",")]
    return found or [Slot(i, "cpu", f"cpu{i}") for i in range(cpu_slots)]
