"""The ``>>>`` examples in hora's docstrings run and show what they say.

Every module of ``hora`` and ``hora_service`` outside ``hora.torch`` is run with
:mod:`doctest` (ELLIPSIS and NORMALIZE_WHITESPACE) in this process; ``hora.torch``'s examples
are collectives and run in a world of their own (tests/dist/test_doctests_torch.py). Examples
that need what a test cannot have here (several ranks, started engines, a running service, a
GPU) are marked ``# doctest: +SKIP`` in place.
"""

from __future__ import annotations

import importlib

import pytest
from helpers.doctests import modules, run

OTHERS = [m for m in modules("hora") + modules("hora_service")
          if m != "hora.torch" and not m.startswith("hora.torch.")]


@pytest.mark.parametrize("name", OTHERS)
def test_module_examples(name: str) -> None:
    attempted, failed, report = run(importlib.import_module(name))
    assert failed == 0, f"{failed} of {attempted} examples failed in {name}:\n{report}"

