"""Whether fresh OS accounts can reach this checkout: the multi-user tests' jobs import it.

Those tests create job accounts and run jobs as them with this checkout's ``kernels`` and its
venv's packages on ``PYTHONPATH`` (the accounts cannot run the test's own interpreter). A
checkout inside a directory other accounts cannot enter (``mktemp -d`` makes them ``0700``)
keeps every such job out: ``No module named 'torch'`` deep in a job's log. Say so at once.
"""

from __future__ import annotations

from pathlib import Path

import hora
import pytest
import torch
from hora_service.users.homes import closed_part

# what the jobs of those tests import: this checkout's hora, and the venv's packages
IMPORTED = (Path(hora.__file__).parents[1], Path(torch.__file__).parents[1])


def require_reachable(paths: tuple[Path, ...] = IMPORTED) -> None:
    """Fail the test, naming the directory, if job accounts cannot reach ``paths``."""
    for path in paths:
        closed = closed_part(path)
        if closed is not None:
            mode = closed.stat().st_mode & 0o777
            pytest.fail(
                f"these tests run jobs as new OS accounts that import {path}, but {closed} "
                f"(mode {mode:04o}) keeps other accounts out: put the checkout where they can "
                "enter (a plain `git clone ... /tmp/hora` does; `mktemp -d` makes a 0700 "
                "directory), or give them search permission on it (chmod o+x)"
            )
