"""What this machine can schedule (control plane): the one inventory of :mod:`hora.inventory`.

The service and the notebook engines share that module, so they never disagree about the GPUs
(``nvidia-smi``, else torch where NVIDIA devices exist, else CPU slots).
"""

from __future__ import annotations

from hora.inventory import Slot, detect_gpus, inventory, parse_nvidia_smi, torch_gpus

__all__ = ["Slot", "detect_gpus", "inventory", "parse_nvidia_smi", "torch_gpus"]
