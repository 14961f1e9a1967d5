"""Enums where strings decide: no product code compares a runtime or a kind to a string.

Runtime (``local``/``docker``/``slurm``), slot kind (``gpu``/``cpu``/``parked``), job kind
(``job``/``session``) and a lease holder's kind (``service``/``kernel``) are the enums of
:mod:`hora.kinds`; code that branches on one compares with a member, so that a renamed or
misspelt value is an ``AttributeError`` (and a mypy error), not a branch never taken. The
check reads the source (``ast``): a comparison, ``==``/``!=``/``in``/``is``, between a name
or attribute whose name ends in ``runtime`` or ``kind`` and a string of those words.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hora.kinds import HolderKind, JobKind, RuntimeName, SlotKind

ROOT = Path(__file__).resolve().parents[2]
WORDS = {m.value for enum in (RuntimeName, SlotKind, JobKind, HolderKind) for m in enum}


def _named(node: ast.expr) -> str | None:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def _words(node: ast.expr) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)
                and isinstance(e.value, str)}  # fmt: skip
    return set()


def string_decisions(source: str) -> list[int]:
    """The lines where a runtime or a kind is compared with one of the enums' words."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = [n for n in map(_named, sides) if n is not None]
        decided = any(n.lower().endswith(("runtime", "kind")) for n in names)
        if decided and any(_words(s) & WORDS for s in sides):
            lines.append(node.lineno)
    return lines


def test_the_check_finds_a_string_decision() -> None:
    assert string_decisions('if plan.slot_kind == "gpu":\n    pass\n') == [1]
    assert string_decisions('ok = args.runtime in ("docker", "slurm")\n') == [1]
    assert string_decisions("if plan.slot_kind == SlotKind.gpu:\n    pass\n") == []
    assert string_decisions('if t.device.type == "cpu":\n    pass\n') == []


@pytest.mark.parametrize("root", ["kernels/hora", "service/hora_service"])
def test_no_product_code_compares_a_runtime_or_kind_with_a_string(root: str) -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / root).rglob("*.py"))
        for line in string_decisions(path.read_text())
    ]
    assert found == [], f"compare with the enum of hora.kinds instead: {found}"
