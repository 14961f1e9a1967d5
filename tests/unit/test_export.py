"""What a job takes from where it is submitted, and where it runs (issue 25, Why 1 and 3).

Pure parts: the ``export`` values of ``hora submit`` / the client (as ``sbatch --export``),
the spec fields they produce, ``submit_dir`` as the default working directory under the
work root (and the note when it is not), the directories a job with a private ``/tmp`` keeps
visible, and the start check looking at paths as such a job will (run in this process, as
the service does for its own account; the e2e tests run it as job accounts).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from hora import jobs_cli
from hora.client import parse_spec
from hora.errors import SpecError
from hora.export import DEFAULT_EXPORT, parse_export, with_export
from hora.spec import JobSpec
from hora_service.jobs.bounds import Bounds
from hora_service.runtimes import namespaces, nsholder, startcheck
from hora_service.settings import Settings
from hora_service.users.homes import closed_part
from hora_service.users.registry import Users

VENV_ENV = {"PATH": "/v/bin:/usr/bin", "VIRTUAL_ENV": "/v", "HORA_TOKEN": "secret", "X": "1"}


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("PATH,VIRTUAL_ENV,CONDA_PREFIX", DEFAULT_EXPORT),
        ("NONE", ()),
        ("", ()),
        (" PATH , X ,PATH", ("PATH", "X")),
        (["LD_LIBRARY_PATH"], ("LD_LIBRARY_PATH",)),
    ],
)
def test_export_values_read_as_sbatch_s(value: str | list[str], names: tuple[str, ...]) -> None:
    assert parse_export(value) == names


@pytest.mark.parametrize("value", ["PATH,$(id)", "A-B", "ALL,X=1"])
def test_an_export_that_is_not_names_is_refused_naming_the_field(value: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_export(value)
    assert e.value.field == "export"


def test_the_default_takes_the_interpreter_and_the_directory_and_nothing_else() -> None:
    data = with_export({"command": ["python"], "env": {"X": "mine"}}, environ=VENV_ENV,
                       cwd=Path("/w/sub"))  # fmt: skip
    spec = parse_spec(data)
    assert spec.env == {"PATH": "/v/bin:/usr/bin", "VIRTUAL_ENV": "/v", "X": "mine"}
    assert spec.submit_dir == "/w/sub" and spec.working_dir is None  # the token stays here


def test_export_none_takes_nothing() -> None:
    data = {"command": ["python"]}
    assert with_export(data, "NONE", environ=VENV_ENV, cwd=Path("/w")) == data


def test_the_job_s_own_env_wins_and_a_docker_job_takes_no_variables() -> None:
    mine = with_export({"command": ["p"], "env": {"PATH": "/mine"}}, environ=VENV_ENV,
                       cwd=Path("/w"))  # fmt: skip
    assert mine["env"] == {"PATH": "/mine", "VIRTUAL_ENV": "/v"}
    for docker in ({"image": "hora:cpu"}, {"runtime": "docker"}):
        data = with_export({"command": ["p"], **docker}, environ=VENV_ENV, cwd=Path("/w"))
        assert "env" not in data and data["submit_dir"] == "/w"


def test_the_client_s_python_comes_first_on_the_exported_path() -> None:
    env = {"PATH": "/usr/bin:/nb/bin:/bin"}
    data = with_export({"command": ["python"]}, environ=env, cwd=Path("/w"),
                       interpreter="/nb/bin/python")  # fmt: skip
    assert data["env"]["PATH"] == "/nb/bin:/usr/bin:/bin"


def test_hora_submit_exports_unless_told_not_to(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VIRTUAL_ENV", "/some/venv")
    parser = jobs_cli.build_parser()
    spec = jobs_cli.spec_from_args(parser.parse_args(["submit", "--", "python", "t.py"]))
    assert spec.env["PATH"] == os.environ["PATH"] and spec.env["VIRTUAL_ENV"] == "/some/venv"
    assert spec.submit_dir == str(tmp_path)
    args = parser.parse_args(["submit", "--export", "NONE", "-e", "A=1", "--", "python"])
    spec = jobs_cli.spec_from_args(args)
    assert spec.env == {"A": "1"} and spec.submit_dir is None
    with pytest.raises(SpecError, match="export"):
        jobs_cli.spec_from_args(parser.parse_args(["submit", "--export", "a b", "--", "x"]))


def test_submit_dir_must_be_absolute() -> None:
    with pytest.raises(SpecError) as e:
        parse_spec({"command": ["x"], "submit_dir": "rel/dir"})
    assert e.value.field == "submit_dir"


def _bounds(root: Path) -> Bounds:
    settings = Settings(data_dir=root / ".data", work_root=root)
    users = Users("single", lambda: None, root)  # type: ignore[arg-type,return-value]
    return Bounds(settings, users, {"PATH": "/usr/bin:/bin"}, 2)


def test_a_job_runs_where_it_was_submitted_under_the_work_root(tmp_path: Path) -> None:
    (tmp_path / "proj" / "sub").mkdir(parents=True)
    bounds = _bounds(tmp_path)
    here = JobSpec(command=["x"], submit_dir=str(tmp_path / "proj" / "sub"))
    assert bounds.workdir(here) == tmp_path / "proj" / "sub"
    assert bounds.submit_note(here) is None and not bounds.uses_default(here)
    given = JobSpec(command=["x"], submit_dir=str(tmp_path / "proj"), working_dir="proj/sub")
    assert bounds.workdir(given) == tmp_path / "proj" / "sub"  # working_dir wins
    gone = JobSpec(command=["x"], submit_dir=str(tmp_path / "gone"))
    with pytest.raises(SpecError) as e:
        bounds.workdir(gone)
    assert e.value.field == "submit_dir" and "not an existing directory" in e.value.message


def test_a_job_submitted_outside_the_work_root_runs_in_the_default_and_says_so(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    bounds = _bounds(root)
    away = JobSpec(command=["x"], submit_dir=str(tmp_path))
    assert bounds.workdir(away) == root and bounds.uses_default(away)
    note = bounds.submit_note(away)
    assert note is not None and str(tmp_path) in note and "work_root" in note, note
    assert "HORA_WORK_ROOT" in note and "--workdir" in note


def test_given_directories_under_tmp_keep_their_prefix() -> None:
    env = {
        "PATH": "/tmp/ck/.venv/bin:relative/bin:/usr/bin:/tmp/bin",
        "PYTHONPATH": "/tmp/ck/kernels:/dev/shm/x/",
        "VIRTUAL_ENV": "/tmp/ck/.venv",
        "CONDA_PREFIX": "/tmp",
    }
    got = namespaces.given_paths(env, "/tmp/tools/bin/prog")
    assert got == (
        "/dev/shm/x", "/tmp/bin", "/tmp/ck/.venv", "/tmp/ck/.venv/bin", "/tmp/ck/kernels",
        "/tmp/tools", "/tmp/tools/bin",
    )  # fmt: skip  (never /tmp itself, though /tmp/bin's parent is /tmp)


def _sight(given: tuple[str, ...], visible: tuple[str, ...] = ()) -> startcheck.Sight:
    return startcheck.Sight(private_tmp=True, visible=visible, given=given)


@pytest.fixture
def venv_in_tmp(tmp_path: Path) -> Path:
    """A prefix under /tmp with a program in bin/ (pytest's tmp_path lies under /tmp)."""
    assert str(tmp_path).startswith("/tmp/")
    prog = tmp_path / "venv" / "bin" / "prog"
    prog.parent.mkdir(parents=True)
    prog.write_text("#!/bin/sh\necho ran\n")
    prog.chmod(0o755)
    return tmp_path / "venv"


def test_a_private_tmp_keeps_what_the_job_was_given_and_reaches(venv_in_tmp: Path) -> None:
    path = f"{venv_in_tmp}/bin:/usr/bin:/bin"
    given = namespaces.given_paths({"PATH": path}, None)
    kept = startcheck.check(None, Path("/"), "prog", path, sight=_sight(given))
    assert set(map(str, kept)) == {str(venv_in_tmp), str(venv_in_tmp / "bin")}


def test_through_a_symlink_the_program_is_hidden_and_the_check_says_so(
    venv_in_tmp: Path,
) -> None:
    link = venv_in_tmp.parent / "link"
    link.symlink_to(venv_in_tmp)
    path = f"{link}/bin:/usr/bin:/bin"
    sight = _sight(namespaces.given_paths({"PATH": path}, None))
    with pytest.raises(SpecError) as e:
        startcheck.check(None, Path("/"), "prog", path, sight=sight)
    assert e.value.field == "command" and str(link / "bin" / "prog") in e.value.message
    assert "hidden from the job" in e.value.message and "/tmp is its own" in e.value.message
    with pytest.raises(SpecError) as e:  # an absolute program: the same, naming it
        startcheck.check(None, Path("/"), str(link / "bin" / "prog"), "/usr/bin", sight=sight)
    assert "hidden from the job" in e.value.message, e.value.message
    # without a private /tmp (single-user mode, sessions) the same program is found
    assert startcheck.check(None, Path("/"), "prog", path) == ()


def test_a_virtual_env_the_job_cannot_use_is_refused_naming_it(venv_in_tmp: Path) -> None:
    missing = str(venv_in_tmp.parent / "nope")
    with pytest.raises(SpecError) as e:
        startcheck.check(None, Path("/"), "sh", "/bin", env={"VIRTUAL_ENV": missing})
    assert e.value.field == "env.VIRTUAL_ENV" and missing in e.value.message
    assert "--export NONE" in e.value.message
    hidden = _sight(())
    with pytest.raises(SpecError) as e:
        startcheck.check(None, Path("/"), "sh", "/bin", env={"CONDA_PREFIX": str(venv_in_tmp)},
                        sight=hidden)  # fmt: skip
    assert e.value.field == "env.CONDA_PREFIX" and "hidden from the job" in e.value.message
    assert startcheck.check(None, Path("/"), "sh", "/bin", env={"VIRTUAL_ENV": sys.prefix}) == ()


def test_the_holder_opens_kept_directories_only_through_real_ones(venv_in_tmp: Path) -> None:
    fd = nsholder._open_real(str(venv_in_tmp / "bin"))
    assert fd is not None
    os.close(fd)
    link = venv_in_tmp.parent / "link"
    link.symlink_to(venv_in_tmp)
    for bad in (str(link / "bin"), str(link), f"{venv_in_tmp}/../venv", "/nonexistent/x"):
        assert nsholder._open_real(bad) is None, bad


def test_a_closed_directory_on_the_way_to_the_work_root_is_named() -> None:
    base = Path(tempfile.mkdtemp(prefix="hora-closed-"))  # pytest's own tmp is closed
    try:
        base.chmod(0o755)
        inner = base / "closed" / "work"
        inner.mkdir(parents=True)
        (base / "closed").chmod(0o700)
        assert closed_part(inner) == base / "closed"
        (base / "closed").chmod(0o711)
        assert closed_part(inner) is None
    finally:
        shutil.rmtree(base)
