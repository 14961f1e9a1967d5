"""Merge per-rank timeline parts into one Chrome-trace JSON file (data plane, no torch).

Each rank of a job streams its events to ``{F}.rank{r}.part`` (one JSON event per line, see
:mod:`hora.torch.timeline`). :func:`merge_parts` folds them into ``F`` as
``{"traceEvents": [...]}``, which Perfetto and chrome://tracing open. Rank 0 calls it at
``stop_timeline()``/``shutdown()``; the ``hora run`` launcher calls it again after every rank
exited, to pick up parts written late or by ranks that died. Importing this module loads only
the standard library.
"""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import Path
from typing import Any

_PART = re.compile(r"\.rank(\d+)\.part$")


def part_path(path: str | os.PathLike[str], rank: int) -> Path:
    """Return the file rank ``rank`` streams its events to for the timeline ``path``."""
    return Path(f"{os.fspath(path)}.rank{rank}.part")


def _read_events(file: Path) -> list[dict[str, Any]]:
    events = []
    for line in file.read_text(errors="replace").splitlines():
        line = line.strip().rstrip(",")
        if not line:
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # a rank killed mid-write leaves a torn last line
            continue
    return events


def _existing(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, OSError):
        return []
    return list(data.get("traceEvents", [])) if isinstance(data, dict) else list(data)


def merge_parts(path: str | os.PathLike[str]) -> bool:
    """Merge every ``{path}.rank*.part`` into ``path`` (keeping events already there).

    Safe to call more than once and from several processes' points of view: parts are
    deleted once merged and the output is replaced atomically.

    Args:
        path: the timeline file given to ``--timeline-filename`` / ``HOROVOD_TIMELINE``.

    Returns:
        True when at least one part was merged (``path`` was written), else False.

    Example:
        >>> merge_parts("/tmp/timeline.json")
        False
    """
    target = Path(path)
    parts = sorted(
        (Path(p) for p in glob.glob(glob.escape(os.fspath(target)) + ".rank*.part")),
        key=lambda p: int(m.group(1)) if (m := _PART.search(p.name)) else 0,
    )
    if not parts:
        return False
    events = _existing(target)
    for part in parts:
        events.extend(_read_events(part))
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    tmp = target.with_name(f".{target.name}.merge{os.getpid()}")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    os.replace(tmp, target)
    for part in parts:
        part.unlink(missing_ok=True)
    return True
