"""Where Horovod's own test suite is, for the conformance tests (tests/conformance/).

Horovod's suite is not part of this repository (no copy of Horovod's code lives here). One
setting says where it is: ``HORA_HOROVOD_SUITE``, a directory holding, as in Horovod's
repository (horovod/horovod at commit :data:`COMMIT`)::

    test/parallel/test_torch.py
    test/single/test_torch_elastic.py
    test/utils/common.py
    horovod/runner/util/threads.py

Unset, it defaults to ``../shared/conformance/horovod`` beside the repository when that exists
(CI's layout). Where neither is there, :func:`suite_dir` skips the calling test with a reason
saying how to get the files; a directory that is there but lacks one of them (named by
``HORA_HOROVOD_SUITE``, or the default) fails the test instead. ``.ci/run`` sets it and fails
when the suite is missing, so CI never skips these tests.

Use :func:`suite_dir` from a test (or the ``horovod_suite`` fixture of
tests/conformance/conftest.py) rather than building paths yourself.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

VAR = "HORA_HOROVOD_SUITE"
REPO = Path(__file__).resolve().parents[2]
DEFAULT = REPO.parent / "shared" / "conformance" / "horovod"
COMMIT = "2626dc87a3a8eb8fb7d2216198ce45bce0f9e65a"
FILES = (
    "test/parallel/test_torch.py",
    "test/single/test_torch_elastic.py",
    "test/utils/common.py",
    "horovod/runner/util/threads.py",
)
HOW_TO_GET = (
    f"Horovod's test suite is not here: set {VAR} to a directory holding {', '.join(FILES)} "
    f"from https://github.com/horovod/horovod at commit {COMMIT} (only these four files are "
    f"needed; default: {DEFAULT} when it exists)"
)


def missing(root: Path) -> list[str]:
    """The files of :data:`FILES` that ``root`` lacks."""
    return [name for name in FILES if not (root / name).is_file()]


def suite_dir() -> Path:
    """The directory holding Horovod's suite; skips the calling test when there is none.

    Raises:
        pytest.skip.Exception: neither ``HORA_HOROVOD_SUITE`` nor the default is set up.
        pytest.fail.Exception: the directory (``HORA_HOROVOD_SUITE``'s or the default) lacks
            one of :data:`FILES`.
    """
    given = os.environ.get(VAR)
    if given:
        root = Path(given).expanduser().resolve()
        lacks = missing(root)
        if lacks:
            pytest.fail(f"{VAR}={given} lacks {', '.join(lacks)}. {HOW_TO_GET}", pytrace=False)
        return root
    if not DEFAULT.is_dir():
        pytest.skip(HOW_TO_GET)
    lacks = missing(DEFAULT)
    if lacks:
        pytest.fail(f"{DEFAULT} lacks {', '.join(lacks)}. {HOW_TO_GET}", pytrace=False)
    return DEFAULT
