"""No module of tests/helpers takes a standard library module's name.

Rank processes of tests/dist and tests/e2e run scripts of tests/helpers (``child.py``,
``lease_holder.py``, ...), so that folder comes first on their ``sys.path``: a helper named
``http.py`` hid the standard library's ``http`` there, and every rank failed importing torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def test_no_helper_module_hides_a_standard_library_module() -> None:
    names = {p.stem for p in HELPERS.glob("*.py")} | {
        p.name for p in HELPERS.iterdir() if (p / "__init__.py").is_file()
    }
    assert "child" in names  # the folder is the one the ranks run from
    assert sorted(names & set(sys.stdlib_module_names)) == []
