"""No module imports another package's private names: each package keeps its privates.

A name that starts with ``_`` (a module such as ``hora.torch._state``, or a function such as
``local._private_file``) belongs to the package that holds it; a module of another package that
imports it ties itself to details its owner may change at will. What another package needs
gets a public door (``hora.torch.host`` for the engines; ``hora.engines._ipp`` wraps
ipyparallel's privates for its own package only). The check reads every module of both
planes (``ast``: ``from X import Y`` and ``import X``, at any depth of the code).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _private_owner(dotted: str) -> str | None:
    """The package that owns the first private part of ``dotted`` (None: all public)."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def foreign_privates(source: str, package: str) -> list[str]:
    """What ``source`` (a module of ``package``) imports from another package's privates."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            owner = _private_owner(name)
            mine = owner is not None and (package == owner or package.startswith(owner + "."))
            if name.startswith("hora") and owner is not None and not mine:
                found.append(f"{node.lineno}: {name}")
    return found


def _package(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] != "__init__" else parts[:-1])


def test_the_check_sees_a_foreign_private_import() -> None:
    code = "from hora.torch import _state\nfrom hora.torch._ops import Op\nimport hora.launch._x\n"
    assert foreign_privates(code, "hora.engines") == [
        "1: hora.torch._state", "2: hora.torch._ops.Op", "3: hora.launch._x"]  # fmt: skip
    assert foreign_privates(code.splitlines()[0], "hora.torch") == []
    assert foreign_privates("from hora.torch import host\n", "hora.engines") == []


@pytest.mark.parametrize("src", ["kernels", "service"])
def test_no_module_imports_another_packages_private_names(src: str) -> None:
    root = ROOT / src
    found = [
        f"{path.relative_to(ROOT)}:{hit}"
        for path in sorted(root.rglob("*.py"))
        for hit in foreign_privates(path.read_text(), _package(path, root))
    ]
    assert found == [], f"give these a public name in their own package: {found}"
