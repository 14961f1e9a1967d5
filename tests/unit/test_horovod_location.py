"""Where the conformance tests find Horovod's suite (tests/helpers/horovod.py).

Real directories in tmp_path; the default location is pointed at one by monkeypatching the
helper's DEFAULT (the real default is beside the repository, which a test must not touch).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import horovod


def _suite(root: Path, files: tuple[str, ...] = horovod.FILES) -> Path:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("# stand-in\n")
    return root


def test_the_setting_names_the_suite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(horovod.VAR, str(_suite(tmp_path / "hvd")))
    monkeypatch.setattr(horovod, "DEFAULT", tmp_path / "absent")
    assert horovod.suite_dir() == (tmp_path / "hvd").resolve()


def test_unset_uses_the_default_when_it_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(horovod.VAR, raising=False)
    monkeypatch.setattr(horovod, "DEFAULT", _suite(tmp_path / "shared"))
    assert horovod.suite_dir() == tmp_path / "shared"


def test_absent_is_a_skip_that_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(horovod.VAR, raising=False)
    monkeypatch.setattr(horovod, "DEFAULT", tmp_path / "absent")
    with pytest.raises(pytest.skip.Exception) as skip:
        horovod.suite_dir()
    reason = str(skip.value)
    assert horovod.VAR in reason and horovod.COMMIT in reason and "horovod/horovod" in reason
    assert all(name in reason for name in horovod.FILES)


@pytest.mark.parametrize("via", ["setting", "default"])
def test_an_incomplete_suite_fails_naming_what_it_lacks(
    via: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _suite(tmp_path / "hvd", horovod.FILES[:-1])
    if via == "setting":
        monkeypatch.setenv(horovod.VAR, str(root))
    else:
        monkeypatch.delenv(horovod.VAR, raising=False)
        monkeypatch.setattr(horovod, "DEFAULT", root)
    with pytest.raises(pytest.fail.Exception, match="lacks horovod/runner/util/threads.py"):
        horovod.suite_dir()
