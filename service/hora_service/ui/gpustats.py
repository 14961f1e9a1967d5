"""GPU memory and utilisation for the dashboard's pool view, from ``nvidia-smi`` (control plane).

Asked at most every ``ttl_s`` seconds (one short subprocess, argument list, bounded by a
timeout); a machine without ``nvidia-smi`` or whose driver does not answer reports nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

from pydantic import BaseModel

QUERY = "index,memory.used,memory.total,utilization.gpu"
TIMEOUT_S = 5.0


class GpuStats(BaseModel):
    """One GPU's memory (MiB) and utilisation (percent); None where the driver says N/A."""

    index: int
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    utilization_pct: float | None = None


def _num(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_stats(text: str) -> dict[int, GpuStats]:
    r"""Parse the CSV of ``nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits``.

    Example:
        >>> parse_stats("0, 1024, 81559, 37\n1, 3, 81559, [N/A]\n")[1].utilization_pct is None
        True
    """
    out: dict[int, GpuStats] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        index = int(cells[0])
        out[index] = GpuStats(
            index=index,
            memory_used_mib=_num(cells[1]),
            memory_total_mib=_num(cells[2]),
            utilization_pct=_num(cells[3]),
        )
    return out


class GpuProbe:
    """Cached ``nvidia-smi`` readings (empty on a machine without GPUs)."""

    def __init__(self, enabled: bool, ttl_s: float = 5.0) -> None:
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.ttl_s = ttl_s
        self._at = 0.0
        self._last: dict[int, GpuStats] = {}
        self._lock = threading.Lock()

    def read(self) -> dict[int, GpuStats]:
        """GPU index -> its stats, at most ``ttl_s`` old."""
        if not self.enabled:
            return {}
        with self._lock:
            if time.monotonic() - self._at < self.ttl_s:
                return self._last
            self._at = time.monotonic()
            argv = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
            try:
                done = subprocess.run(
                    argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
                )
                self._last = parse_stats(done.stdout) if done.returncode == 0 else {}
            except (OSError, subprocess.TimeoutExpired):
                self._last = {}
            return self._last
