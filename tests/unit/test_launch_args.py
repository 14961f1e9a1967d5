"""hora run: argument parsing, per-rank environments, exit-code mapping, messages (pure)."""

from __future__ import annotations

import io
import signal
import socket
from pathlib import Path

import pytest
from hora.env import detect_world
from hora.errors import SpecError
from hora.launch import cli
from hora.launch.config import (
    LaunchConfig,
    build_rank_envs,
    launch_extra,
    parse_args,
    parse_hosts,
)
from hora.launch.launcher import LaunchResult, RankExit
from hora.launch.output import PrefixedSink, prefix
from hora.launch.procs import exit_code


@pytest.mark.parametrize(
    ("argv", "np", "command"),
    [
        (["-np", "2", "--", "python", "x.py"], 2, ("python", "x.py")),
        (["-np", "2", "python", "x.py", "--epochs", "3"], 2, ("python", "x.py", "--epochs", "3")),
        (["-np=3", "true"], 3, ("true",)),
        (["--num-proc", "4", "true"], 4, ("true",)),
        (["--nproc_per_node", "2", "true"], 2, ("true",)),
        # flags after the command belong to the command, even hora run's own names
        (["-np", "2", "--", "python", "-np", "9", "--", "x"], 2, ("python", "-np", "9", "--", "x")),
        (["-H", "localhost:3", "true"], 3, ("true",)),
        (["-H", "localhost:2,127.0.0.1:2", "-np", "3", "true"], 3, ("true",)),
        (["--hosts", "localhost", "true"], 1, ("true",)),
    ],
)
def test_parse_valid(argv: list[str], np: int, command: tuple[str, ...]) -> None:
    cfg = parse_args(argv)
    assert cfg.np == np
    assert cfg.command == command
    assert cfg.timeline_filename is None and cfg.start_timeout is None and cfg.backend is None


def test_parse_all_flags(tmp_path: Path) -> None:
    cfg = parse_args(
        ["-np", "2", "--timeline-filename", "t.json", "--start-timeout", "7.5",
         "--master-port", "4321", "--backend", "GLOO", "--grace-period", "0.5", "--", "true"],
        cwd=tmp_path,
    )
    assert cfg == LaunchConfig(np=2, command=("true",), timeline_filename=tmp_path / "t.json",
                               start_timeout=7.5, master_port=4321, backend="gloo",
                               grace_period=0.5)


@pytest.mark.parametrize(
    ("argv", "field", "words"),
    [
        (["true"], "-np", "missing"),
        (["-np"], "-np", "expected one argument"),
        (["-np", "two", "true"], "-np", "integer"),
        (["-np", "0", "true"], "-np", "between 1"),
        (["-np", "2"], "command", "missing"),
        (["-np", "2", "--"], "command", "missing"),
        (["-np", "2", "no-such-program-hora-xyz"], "command", "not found on PATH"),
        (["-np", "2", "./no/such/file.sh"], "command", "not executable"),
        (["-np", "2", "--bogus", "true"], "--bogus", "unknown option"),
        (["-np", "2", "--start-timeout", "0", "true"], "--start-timeout", "between"),
        (["-np", "2", "--start-timeout", "soon", "true"], "--start-timeout", "number"),
        (["-np", "2", "--master-port", "70000", "true"], "--master-port", "between 1 and 65535"),
        (["-np", "2", "--backend", "mpi", "true"], "--backend", "gloo, nccl"),
        (["-np", "2", "--grace-period", "-1", "true"], "--grace-period", "between"),
        (["-np", "2", "--timeline-filename", "/no/such/dir/t.json", "true"],
         "--timeline-filename", "does not exist"),
        (["-np", "2", "--timeline-filename", "", "true"], "--timeline-filename", "empty"),
        (["-H", "gpu-node-1:4", "true"], "--hosts", "multi-host comes later"),
        (["-H", "localhost:x", "true"], "--hosts", "integer"),
        (["-H", "localhost:2", "-np", "3", "true"], "-np", "do not fit"),
    ],
)
def test_parse_errors_name_the_flag(argv: list[str], field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_args(argv)
    assert err.value.field == field
    assert words in str(err.value)


def test_timeline_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="is a directory"):
        parse_args(["-np", "1", "--timeline-filename", str(tmp_path), "true"])


def test_hosts_accepts_this_machines_name() -> None:
    name = socket.gethostname()
    assert parse_hosts(f"{name}:2", [name]) == 2
    with pytest.raises(SpecError, match="not this machine"):
        parse_hosts(f"{name}:2")


@pytest.mark.parametrize("hostile", ["a b", "it's", '"q"', "$(rm -rf /)", "`id`", "; echo x", "*"])
def test_hostile_arguments_pass_through_verbatim(hostile: str) -> None:
    cfg = parse_args(["-np", "2", "--", "python", "x.py", hostile])
    assert cfg.command == ("python", "x.py", hostile)


def _cfg(**kw: object) -> LaunchConfig:
    return LaunchConfig(**{"np": 3, "command": ("true",), **kw})  # type: ignore[arg-type]


def test_rank_envs_place_each_rank_in_one_world() -> None:
    envs = build_rank_envs(_cfg(), {"PATH": "/bin", "HOME": "/root"}, 4242)
    assert len(envs) == 3
    for r, env in enumerate(envs):
        world = detect_world(env)
        assert (world.rank, world.size, world.local_rank, world.local_size) == (r, 3, r, 3)
        assert (world.master_addr, world.master_port, world.launcher) == ("127.0.0.1", 4242, "hora")
        assert env["PATH"] == "/bin" and env["HOME"] == "/root"
        assert env["PYTHONUNBUFFERED"] == "1" and env["OMP_NUM_THREADS"] == "1"
        assert not {"HOROVOD_TIMELINE", "HORA_TIMEOUT", "HORA_BACKEND"} & set(env)


def test_rank_envs_drop_a_parent_launchers_world_and_keep_user_settings() -> None:
    parent = {"RANK": "5", "WORLD_SIZE": "8", "MASTER_PORT": "1", "OMPI_COMM_WORLD_RANK": "5",
              "OMPI_COMM_WORLD_SIZE": "8", "SLURM_PROCID": "5", "PMI_RANK": "5",
              "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "", "HORA_RESTART_COUNT": "2"}
    before = dict(parent)
    envs = build_rank_envs(_cfg(np=2), parent, 5555)
    assert parent == before  # the base environment is not mutated
    for r, env in enumerate(envs):
        assert env["RANK"] == str(r) and env["WORLD_SIZE"] == "2" and env["MASTER_PORT"] == "5555"
        assert not {"OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK"} & set(env)
        assert env["OMP_NUM_THREADS"] == "4" and env["PYTHONUNBUFFERED"] == ""
        assert env["HORA_RESTART_COUNT"] == "2"


def test_rank_envs_are_independent_dicts() -> None:
    envs = build_rank_envs(_cfg(np=2), {}, 1)
    envs[0]["X"] = "1"
    assert "X" not in envs[1]


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, {}),
        ({"timeline_filename": Path("/t/x.json")}, {"HOROVOD_TIMELINE": "/t/x.json"}),
        ({"start_timeout": 30.0}, {"HORA_START_TIMEOUT": "30", "HORA_TIMEOUT": "30"}),
        ({"start_timeout": 2.5}, {"HORA_START_TIMEOUT": "2.5", "HORA_TIMEOUT": "2.5"}),
        ({"backend": "nccl"}, {"HORA_BACKEND": "nccl"}),
    ],
)
def test_launch_extra(kw: dict[str, object], expected: dict[str, str]) -> None:
    assert launch_extra(_cfg(**kw)) == expected
    for env in build_rank_envs(_cfg(**kw), {}, 1):
        assert expected.items() <= env.items()


@pytest.mark.parametrize(("rc", "code"), [(0, 0), (3, 3), (-signal.SIGKILL, 137),
                                          (-signal.SIGTERM, 143), (-signal.SIGINT, 130), (256, 0)])
def test_exit_code_maps_signals_to_128_plus(rc: int, code: int) -> None:
    assert exit_code(rc) == code


def test_prefixed_sink_adds_prefix_and_missing_newline() -> None:
    text = io.StringIO()
    sink = PrefixedSink(text)
    sink.write_line(prefix(0, "stdout"), b"done\n")
    sink.write_line(prefix(12, "stderr"), b"partial")
    assert text.getvalue() == "[0]<stdout>:done\n[12]<stderr>:partial\n"


def test_prefixed_sink_writes_raw_bytes_when_it_can() -> None:
    raw = io.BytesIO()
    sink = PrefixedSink(io.TextIOWrapper(raw, encoding="utf-8"))
    sink.write_line(prefix(1, "stdout"), b"\xff\xfe not utf-8\n")
    assert raw.getvalue() == b"[1]<stdout>:\xff\xfe not utf-8\n"


@pytest.mark.parametrize(
    ("result", "line"),
    [
        (LaunchResult(0, ()), None),
        (LaunchResult(3, (RankExit(1, 3, False),), first_failure=RankExit(1, 3, False)),
         "rank 1 on localhost failed with exit code 3"),
        (LaunchResult(137, (), first_failure=RankExit(0, 137, False), also_failed=(2,)),
         "rank 0 on localhost failed with exit code 137 (also failed on ranks 2)"),
        (LaunchResult(143, (), signal=15), "interrupted by signal 15; exit code 143"),
    ],
)
def test_describe(result: LaunchResult, line: str | None) -> None:
    assert cli.describe(result) == line


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["run"], "-np"),
        (["run", "-np", "0", "true"], "-np"),
        (["run", "-np", "2", "--backend", "x", "true"], "--backend"),
        (["run", "-np", "2"], "command"),
    ],
)
def test_cli_bad_arguments_exit_2_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hora run: error: {flag}:")


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("-np", "--timeline-filename", "--start-timeout", "--master-port", "--backend"):
        assert flag in out


@pytest.mark.parametrize(
    ("args", "start"),
    [
        (["-np", "2", "python", "x.py", "--help"], 2),
        (["-np=2", "--backend", "gloo", "python"], 3),
        (["-np", "2", "--", "python", "-h"], 2),
        (["--help"], 1),
    ],
)
def test_help_after_the_command_belongs_to_the_command(args: list[str], start: int) -> None:
    assert cli._command_start(args) == start
