"""What the structure tests read in a fresh interpreter, and the one cycle check they share.

CPython 3.11.7's ``ast.parse`` can fail late in a long test process, so a test that parses the
whole code base runs its own file as a script (``if __name__ == "__main__": print(json...)``)
and reads the JSON it prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def main_output(script: str) -> object:
    """The JSON that ``python script`` prints (the test module's own ``__main__`` block); the
    script imports ``helpers`` as the tests do (tests/ on its path)."""
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, check=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": path})  # fmt: skip
    return json.loads(out.stdout)


def import_graph(script: str) -> dict[str, set[str]]:
    """An import graph ``{module: imported modules}`` that ``script`` prints as JSON lists."""
    read = main_output(script)
    assert isinstance(read, dict)
    return {k: set(v) for k, v in read.items()}


def assert_no_cycle(graph: Mapping[str, set[str]]) -> None:
    """Fail, naming the first cycle found (``a -> b -> a``), if the graph has one."""
    done: set[str] = set()

    def visit(mod: str, path: list[str]) -> None:
        if mod in path:
            raise AssertionError("import cycle: " + " -> ".join([*path, mod]))
        if mod not in done:
            for dep in sorted(graph.get(mod, set())):
                visit(dep, [*path, mod])
            done.add(mod)

    for mod in sorted(graph):
        visit(mod, [])
