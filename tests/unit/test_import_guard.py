"""Import-time dependencies point one way (docs/dev/architecture.md, "Conventions the tests
hold"): checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN_FOR_TORCH = (
    "fastapi",
    "ipyparallel",
    "IPython",
    "hora_service",
    "uvicorn",
    "sqlalchemy",
    "httpx",
    "pydantic_settings",
)
FORBIDDEN_FOR_HORA = ("torch", "fastapi", "hora_service", "IPython", "ipyparallel", "uvicorn")


def _modules_after(stmt: str) -> set[str]:
    code = f"import sys, json; {stmt}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _top(mods: set[str]) -> set[str]:
    return {m.split(".")[0] for m in mods}


def test_import_hora_torch_loads_only_torch_stdlib_and_hora() -> None:
    tops = _top(_modules_after("import hora.torch"))
    assert "torch" in tops
    bad = sorted(tops & set(FORBIDDEN_FOR_TORCH))
    assert not bad, f"import hora.torch pulled in {bad}"
    beyond_torch = tops - _top(_modules_after("import torch, torch.distributed, torch.nn"))
    extra = sorted(m for m in beyond_torch - set(sys.stdlib_module_names) if not m.startswith("_"))
    assert extra == ["hora"], f"import hora.torch loads more than torch + stdlib + hora: {extra}"


@pytest.mark.parametrize(
    "stmt",
    ["import hora", "import hora.env", "import hora.contract", "import hora.errors",
     "import hora.timeline_merge", "import hora.scaling"],
)
def test_light_modules_load_no_heavy_dependency(stmt: str) -> None:
    bad = sorted(_top(_modules_after(stmt)) & set(FORBIDDEN_FOR_HORA))
    assert not bad, f"{stmt} pulled in {bad}"
