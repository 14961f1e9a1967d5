"""The private names of ipyparallel, torch.distributed and cloudpickle: one adapter module each.

``hora.engines._ipp``, ``hora.torch._dist`` and ``hora.engines._pickling`` are the only modules
that may reach them (see docs/dev/architecture.md); an upgrade that moves one then breaks in
one place.
"""

from __future__ import annotations

import re
from pathlib import Path

import hora
import pytest

ROOT = Path(hora.__file__).parent
# what each adapter owns: a pattern for its private names
OWNED = {
    "engines/_ipp.py": re.compile(
        r"\._engines\b|\._mux_stream\b|\._send_control_request\b|\b_content\b"
    ),
    "torch/_dist.py": re.compile(r"distributed_c10d\._|\bdist\._[a-z]|torch\._C\._distributed"),
    "engines/_pickling.py": re.compile(r"\._dynamic_function_reduce\b|cloudpickle\.cloudpickle\b"),
}


def _users(pattern: re.Pattern[str], owner: str) -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == owner:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                found.append(f"hora/{rel}:{n}: {line.strip()}")
    return found


@pytest.mark.parametrize("owner", sorted(OWNED))
def test_only_the_adapter_reaches_the_private_names(owner: str) -> None:
    assert (ROOT / owner).exists()
    assert _users(OWNED[owner], owner) == []


@pytest.mark.parametrize("owner", sorted(OWNED))
def test_the_adapter_itself_is_seen(owner: str) -> None:
    """The pattern matches the adapter's own uses (so an empty result above means something)."""
    text = (ROOT / owner).read_text()
    assert OWNED[owner].search(text)
