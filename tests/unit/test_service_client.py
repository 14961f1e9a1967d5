"""Pure parts of the job client, the job CLI and the API helpers (no server)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path

import httpx
import pytest
from hora.client import (
    Client,
    ServiceError,
    ServiceUnavailable,
    _raise_for_status,
    load_config,
    parse_spec,
    render_detail,
    save_config,
)
from hora.errors import EngineRunning, SpecError
from hora.jobs_cli import build_parser, main, parse_env, spec_from_args
from hora.jobs_text import age, format_table, status_text
from hora.spec import JobState
from hora.sse import parse_sse


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_import_client_stays_light() -> None:
    code = (
        "import sys, hora, hora.client, hora.jobs_cli; "
        "heavy = ('fastapi', 'hora_service', 'uvicorn', 'starlette', 'torch'); "
        "bad = [m for m in heavy if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == ""


@pytest.mark.parametrize(
    ("args", "env", "file", "want"),
    [
        (
            ("http://a:1", "t1"),
            {"HORA_URL": "http://b:2", "HORA_TOKEN": "t2"},
            None,
            ("http://a:1", "t1"),
        ),
        (
            (None, None),
            {"HORA_URL": "http://b:2/", "HORA_TOKEN": "t2"},
            {"url": "http://c:3", "token": "t3"},
            ("http://b:2", "t2"),
        ),
        ((None, None), {}, {"url": "http://c:3", "token": "t3"}, ("http://c:3", "t3")),
        ((None, None), {}, None, ("http://127.0.0.1:8000", None)),
        (("http://a:1", None), {}, {"url": "http://c:3", "token": "t3"}, ("http://a:1", "t3")),
    ],
)
def test_config_precedence(tmp_path: Path, args, env, file, want) -> None:
    cfg = tmp_path / "config"
    if file is not None:
        cfg.write_text(json.dumps(file))
        cfg.chmod(0o600)
    got = load_config(*args, environ={**env, "HORA_CONFIG": str(cfg)})
    assert (got.url, got.token) == want


@pytest.mark.parametrize("content", ["not json", "[1, 2]"])
def test_bad_config_file_names_it(tmp_path: Path, content: str) -> None:
    cfg = tmp_path / "config"
    cfg.write_text(content)
    cfg.chmod(0o600)
    with pytest.raises(SpecError) as e:
        load_config(environ={"HORA_CONFIG": str(cfg)})
    assert e.value.field == "config" and str(cfg) in str(e.value)


def test_config_readable_by_others_is_refused(tmp_path: Path) -> None:
    cfg = save_config("http://127.0.0.1:9", "secret", tmp_path / "config")
    cfg.chmod(0o644)
    with pytest.raises(SpecError) as e:
        load_config(environ={"HORA_CONFIG": str(cfg)})
    assert e.value.field == "config" and "chmod 600" in str(e.value)
    got = load_config("http://a:1", "t", environ={"HORA_CONFIG": str(cfg)})
    assert got.token == "t"  # not read at all when both are given


def test_default_config_dir_is_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".hora").mkdir(mode=0o755)
    path = save_config("http://127.0.0.1:9", "secret", tmp_path / ".hora" / "config")
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


def test_save_config_is_private(tmp_path: Path) -> None:
    path = save_config("http://127.0.0.1:9", "secret", tmp_path / "sub" / "config")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    got = load_config(environ={"HORA_CONFIG": str(path)})
    assert (got.url, got.token) == ("http://127.0.0.1:9", "secret")


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"command": []}, "command"),
        ({"command": ["python"], "workers": 0}, "workers"),
        ({"command": ["python"], "gpus_per_worker": 99}, "gpus_per_worker"),
        ({"command": ["python"], "env": {"1BAD": "x"}}, "env"),
        ({"command": ["python"], "priority": "urgent"}, "priority"),
        ({"command": ["python"], "bogus": 1}, "bogus"),
    ],
)
def test_parse_spec_names_field(data: dict, field: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    assert e.value.field == field


def test_submit_string_command_fails_before_network() -> None:
    with Client(f"http://127.0.0.1:{_closed_port()}", "t") as c, pytest.raises(SpecError) as e:
        c.submit("python train.py")
    assert e.value.field == "command"


def test_unreachable_service_names_url() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    with Client(url, "t", timeout=5) as c, pytest.raises(ServiceUnavailable) as e:
        c.gpus()
    assert f"{url}/v1/gpus" in str(e.value)


def test_parse_sse_events() -> None:
    lines = [
        ": keep-alive",
        "",
        "id: 5",
        'data: "hello\\n"',
        "",
        "event: end",
        "id: 5",
        'data: {"state": "succeeded"}',
        "",
        "data: a",
        "data: b",
        "",
    ]
    events = list(parse_sse(iter(lines)))
    assert [(e.event, e.id) for e in events] == [("message", "5"), ("end", "5"), ("message", None)]
    assert json.loads(events[0].data) == "hello\n"
    assert events[2].data == "a\nb"


def test_render_detail_of_validation_errors() -> None:
    detail = [{"loc": ["body", "workers"], "msg": "asks for 8 GPUs; this cluster has 4"}]
    assert render_detail(detail) == "workers: asks for 8 GPUs; this cluster has 4"
    err = ServiceError(422, detail, "http://x/v1/jobs")
    assert "workers: asks for 8 GPUs" in str(err) and err.status == 422


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"detail": "rank 1's engine of session 3 is running", "code": "engine_running"},
         EngineRunning.code),
        ({"detail": "rank 1's engine of session 3 is running"}, None),  # text is never a code
        ({"detail": "x", "code": 7}, None),
    ],
)  # fmt: skip
def test_a_service_error_carries_the_code_code_acts_on(body: dict[str, object], code: str) -> None:
    request = httpx.Request("POST", "http://x/v1/sessions/3/replace")
    with pytest.raises(ServiceError) as e:
        _raise_for_status(httpx.Response(409, json=body, request=request))
    assert e.value.status == 409 and e.value.code == code


def test_submit_args_become_spec() -> None:
    args = build_parser().parse_args(
        [
            "submit",
            "--workers",
            "2",
            "--gpus",
            "1",
            "--name",
            "digits",
            "-e",
            "A=1",
            "--env",
            "B=x=y",
            "--priority",
            "high",
            "--max-retries",
            "2",
            "--timeout",
            "60",
            "--submission-id",
            "s-1",
            "--",
            "python",
            "train.py",
            "--epochs",
            "3",
        ]
    )
    spec = spec_from_args(args)
    assert spec.command == ["python", "train.py", "--epochs", "3"]
    assert (spec.workers, spec.gpus_per_worker, spec.name) == (2, 1, "digits")
    assert {k: spec.env[k] for k in ("A", "B")} == {"A": "1", "B": "x=y"}
    assert spec.env["PATH"] == os.environ["PATH"]  # exported from here (tests/unit/test_export.py)
    assert (spec.priority.value, spec.max_retries, spec.timeout_s, spec.submission_id) == (
        "high",
        2,
        60.0,
        "s-1",
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["submit"], "command"),
        (["submit", "--env", "NOVALUE", "--", "python"], "env"),
        (["submit", "--workers", "0", "--", "python"], "workers"),
    ],
)
def test_submit_usage_errors_exit_2(argv: list[str], needle: str) -> None:
    out, err = StringIO(), StringIO()
    assert main(argv, out, err) == 2
    assert needle in err.getvalue()


def test_parse_env_rejects_missing_equals() -> None:
    with pytest.raises(SpecError):
        parse_env(["=x"])


def test_format_table_aligns() -> None:
    assert format_table(["A", "BB"], [[1, None], ["long", "x"]]).splitlines() == [
        "A     BB",
        "1",
        "long  x",
    ]


@pytest.mark.parametrize(
    ("secs", "want"), [(0, "0s"), (59, "59s"), (61, "1m"), (7200, "2h"), (90000, "1d")]
)
def test_age(secs: int, want: str) -> None:
    t0 = datetime(2024, 1, 1, tzinfo=UTC)
    assert age(t0, datetime.fromtimestamp(t0.timestamp() + secs, UTC)) == want


def test_status_text_shows_ranks_and_transitions() -> None:
    from hora.client import JobInfo

    info = JobInfo.model_validate(
        {
            "id": 3,
            "user": "ann",
            "state": "failed",
            "attempt": 2,
            "reason": "rank 1 exited with 3",
            "spec": {"command": ["python", "t.py"], "workers": 2, "max_retries": 1},
            "exit_codes": {"0": 0, "1": 3},
            "transitions": [{"state": "queued", "at": "2024-01-01T00:00:00Z", "reason": None}],
        }
    )
    text = status_text(info)
    assert info.state is JobState.failed
    assert "rank 1 exited with 3" in text and "attempt:  2" in text
    assert any(line.split() == ["1", "3"] for line in text.splitlines())
    assert "queued" in text


def test_clients_share_one_tls_context_that_still_verifies(monkeypatch: pytest.MonkeyPatch) -> None:
    import ssl

    from hora import client as client_mod

    made: list[ssl.SSLContext] = []
    real = httpx.create_ssl_context

    def counting() -> ssl.SSLContext:
        made.append(real())
        return made[-1]

    client_mod._tls.cache_clear()
    monkeypatch.setattr(client_mod.httpx, "create_ssl_context", counting)
    try:
        clients = [Client(url, token="t") for url in
                   ("http://127.0.0.1:1", "https://127.0.0.1:1", "http://localhost:2")]
        for c in clients:
            c.close()
    finally:
        client_mod._tls.cache_clear()
    assert len(made) == 1  # the CA bundle is loaded once per process, not per client
    assert made[0].verify_mode == ssl.CERT_REQUIRED and made[0].check_hostname
