"""Rank side of the shared world (see conftest.py): run several test modules' suites at once.

Each module is loaded by path and its ``suite(hvd, rank, size)`` called in the order given,
after one ``hvd.init()``; the results come back keyed by the module's file stem. A suite
records its own cases' errors, so one broken case does not take the others down.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any


def _load(path: str) -> Any:
    name = f"_hora_suite_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def _rank_body(rank: int, size: int, files: list[str]) -> dict[str, Any]:
    mods = {Path(f).stem: _load(f) for f in files}
    import hora.torch as hvd

    hvd.init()
    results = {stem: mod.suite(hvd, rank, size) for stem, mod in mods.items()}
    hvd.shutdown()
    return results
