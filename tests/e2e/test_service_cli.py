"""`hora submit/jobs/status/logs/cancel/gpus` and `hora.Client` against a real server."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import hora
import httpx
import pytest
from helpers.service_server import ServiceServer, free_port, write_scripts
from hora.client import Client, JobWaitTimeout, ServiceError, ServiceUnavailable
from hora.errors import SpecError

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    with ServiceServer(
        tmp_path_factory.mktemp("svc-cli"), {"ann": False, "root": True}, cpu_slots=4
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_scripts(tmp_path_factory.mktemp("scripts"))


@pytest.fixture
def client(server: ServiceServer) -> Iterator[Client]:
    with Client(server.url, server.tokens["ann"]) as c:
        yield c


def cli_env(server: ServiceServer, tmp: Path, token: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in server.env.items() if not k.startswith("HORA_")}
    env.update(
        {
            "HORA_URL": server.url,
            "HORA_TOKEN": token or server.tokens["ann"],
            "HORA_CONFIG": str(tmp / "no-config"),
        }
    )
    return env


def hora_cmd(
    server: ServiceServer, tmp: Path, *args: str, token: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "hora.cli", *args],
        env=cli_env(server, tmp, token),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def job_id_of(text: str) -> int:
    m = re.search(r"submitted job (\d+)", text)
    assert m, text
    return int(m.group(1))


def test_submit_wait_succeeds_and_prints_logs(
    server: ServiceServer, scripts: dict[str, Path], tmp_path: Path
) -> None:
    out = hora_cmd(
        server,
        tmp_path,
        "submit",
        "--wait",
        "--workers",
        "2",
        "--name",
        "hello",
        "-e",
        "A=1",
        "--",
        PY,
        str(scripts["hello"]),
    )
    assert out.returncode == 0, out.stderr
    assert "hello from rank 0 of 2" in out.stdout
    progress = out.stderr.splitlines()
    assert progress[0].startswith("submitted job") and progress[-1].endswith(": succeeded")


def test_submit_wait_follows_every_attempt(
    server: ServiceServer, scripts: dict[str, Path], tmp_path: Path
) -> None:
    out = hora_cmd(
        server, tmp_path, "submit", "--wait", "--max-retries", "1", "--", PY, str(scripts["flaky"])
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.index("restart count 0") < out.stdout.index("restart count 1")
    assert "retrying" in out.stderr


def test_submit_wait_failed_exits_1(
    server: ServiceServer, scripts: dict[str, Path], tmp_path: Path
) -> None:
    out = hora_cmd(server, tmp_path, "submit", "--wait", "-w", "2", "--", PY, str(scripts["fail"]))
    assert out.returncode == 1, out.stderr
    assert "failed" in out.stderr


def test_submit_wait_cancelled_exits_130(
    server: ServiceServer, scripts: dict[str, Path], tmp_path: Path
) -> None:
    cmd = [
        PY,
        "-m",
        "hora.cli",
        "submit",
        "--wait",
        "--",
        PY,
        str(scripts["sleeper"]),
        str(tmp_path / "p"),
    ]
    errf = tmp_path / "err.txt"
    with errf.open("w") as err:
        proc = subprocess.Popen(
            cmd, env=cli_env(server, tmp_path), stdout=subprocess.PIPE, stderr=err, text=True
        )
    try:
        deadline = time.monotonic() + 60
        # until the rank runs: it writes its pid file, then prints "ready" (--wait follows the
        # log from `starting` on, so no "running" line comes to wait for)
        while not (tmp_path / "p" / "0").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (tmp_path / "p" / "0").exists(), errf.read_text()
        job_id = job_id_of(errf.read_text())
        cancel = hora_cmd(server, tmp_path, "cancel", str(job_id))
        # the state the cancel led to, not the one it found
        assert cancel.returncode == 0 and cancel.stdout == f"job {job_id}: cancelled\n"
        assert proc.wait(timeout=60) == 130
        assert "ready" in (proc.stdout.read() if proc.stdout else "")
        assert "cancelled" in errf.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_jobs_status_and_gpus_tables(
    server: ServiceServer, scripts: dict[str, Path], tmp_path: Path
) -> None:
    sub = hora_cmd(
        server, tmp_path, "submit", "--name", "tabled", "-w", "2", "--", PY, str(scripts["fail"])
    )
    assert sub.returncode == 0, sub.stderr
    job_id = job_id_of(sub.stdout)
    with Client(server.url, server.tokens["ann"]) as c:
        c.job(job_id).wait(60)
    jobs = hora_cmd(server, tmp_path, "jobs", "--state", "failed")
    # this service has CPU slots only: what a worker holds is called a slot, not a GPU
    assert jobs.returncode == 0 and jobs.stdout.split()[:6] == [
        "ID",
        "KIND",
        "NAME",
        "USER",
        "STATE",
        "WORKERSxSLOTS",
    ]
    row = next(line for line in jobs.stdout.splitlines() if line.split()[0] == str(job_id))
    assert row.split()[1:6] == ["job", "tabled", "ann", "failed", "2x1"]
    status = hora_cmd(server, tmp_path, "status", str(job_id))
    assert status.returncode == 0 and "state:    failed" in status.stdout
    assert "workers:  2 x 1 slot " in status.stdout and "GPU" not in status.stdout
    assert any(line.split() == ["1", "3"] for line in status.stdout.splitlines())  # rank 1 exit 3
    gpus = hora_cmd(server, tmp_path, "gpus")
    assert gpus.returncode == 0 and gpus.stdout.split()[:5] == [
        "SLOT",
        "KIND",
        "NAME",
        "JOB",
        "USER",
    ]
    assert len(gpus.stdout.strip().splitlines()) == 5


def test_logs_and_logs_follow(
    server: ServiceServer, scripts: dict[str, Path], tmp_path: Path
) -> None:
    sub = hora_cmd(
        server, tmp_path, "submit", "-w", "2", "--", PY, str(scripts["chatty"]), "40", "0.05"
    )
    job_id = job_id_of(sub.stdout)
    followed = hora_cmd(server, tmp_path, "logs", "-f", str(job_id))
    assert followed.returncode == 0, followed.stderr
    lines = followed.stdout.splitlines()
    assert lines[0].startswith("line 0000") and lines[-1] == "done" and len(lines) == 41
    plain = hora_cmd(server, tmp_path, "logs", "--rank", "1", str(job_id))
    assert plain.stdout == followed.stdout
    bad = hora_cmd(server, tmp_path, "logs", "--rank", "7", str(job_id))
    assert bad.returncode == 1 and "rank" in bad.stderr


@pytest.mark.parametrize("follow", [[], ["-f"]], ids=["plain", "follow"])
def test_logs_of_a_rank_that_wrote_nothing_say_so(
    server: ServiceServer, tmp_path: Path, follow: list[str]
) -> None:
    quiet = tmp_path / "quiet.py"
    quiet.write_text("import os\nif os.environ['RANK'] == '0':\n    print('only rank 0 talks')\n")
    sub = hora_cmd(server, tmp_path, "submit", "-w", "2", "--", PY, str(quiet))
    job_id = job_id_of(sub.stdout)
    with Client(server.url, server.tokens["ann"]) as c:
        assert c.job(job_id).wait(60).state.value == "succeeded"
    out = hora_cmd(server, tmp_path, "logs", *follow, "--rank", "1", str(job_id))
    assert out.returncode == 0 and out.stdout == ""
    assert (
        out.stderr
        == f"hora logs: rank 1 of job {job_id} wrote nothing (attempt 1; job succeeded)\n"
    )
    talk = hora_cmd(server, tmp_path, "logs", *follow, "--rank", "0", str(job_id))
    assert talk.stdout == "only rank 0 talks\n" and talk.stderr == ""


@pytest.mark.parametrize(
    ("args", "token", "needle"),
    [
        (["jobs"], "bad-token", "authentication failed"),
        (["status", "999999"], None, "not found"),
        (["submit", "-w", "8", "--", "python", "x.py"], None, "8"),
    ],
)
def test_cli_errors_are_one_clear_line(
    server: ServiceServer, tmp_path: Path, args: list[str], token: str | None, needle: str
) -> None:
    out = hora_cmd(server, tmp_path, *args, token=token)
    assert out.returncode == 1
    assert needle in out.stderr and "Traceback" not in out.stderr


def test_cli_unreachable_names_the_url(server: ServiceServer, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = hora_cmd(server, tmp_path, "jobs", "--url", url)
    assert out.returncode == 1 and url in out.stderr and "Traceback" not in out.stderr


def test_client_submit_wait_logs(client: Client, scripts: dict[str, Path]) -> None:
    job = client.submit([PY, str(scripts["hello"])], workers=2, name="from-client", env={"X": "1"})
    assert isinstance(job, hora.Job) and job.id > 0
    final = job.wait(timeout=60)
    assert final.state.value == "succeeded" and final.name == "from-client"
    assert "hello from rank 1 of 2" in job.logs(rank=1)
    assert job.logs(rank=0, follow=True) == job.logs(rank=0)


def test_client_cancel_and_wait_timeout(
    client: Client, scripts: dict[str, Path], tmp_path: Path
) -> None:
    job = client.submit([PY, str(scripts["sleeper"]), str(tmp_path)])
    with pytest.raises(JobWaitTimeout):
        job.wait(timeout=0.5, poll=0.1)
    job.cancel()
    assert job.wait(timeout=30).state.value == "cancelled"


def test_client_errors_are_hora_errors(server: ServiceServer, client: Client) -> None:
    with pytest.raises(ServiceError) as e:
        client.submit(["python", "x.py"], workers=8)
    assert e.value.status == 422 and "workers" in str(e.value)
    with pytest.raises(ServiceError) as e:
        client.job(999999)
    assert e.value.status == 404
    with Client(server.url, "wrong") as bad, pytest.raises(ServiceError) as e:
        bad.jobs()
    assert e.value.status == 401
    with pytest.raises(SpecError):
        client.submit(["python"], workers=0)
    with Client(f"http://127.0.0.1:{free_port()}", "t") as down, pytest.raises(ServiceUnavailable):
        down.health()


def test_the_client_answers_with_the_service_s_models(
    server: ServiceServer, client: Client, scripts: dict[str, Path]
) -> None:
    from hora.service_wire import Health, JobList
    from hora.spec import JobInfo

    done = [client.submit([PY, str(scripts["hello"])]).wait(timeout=60) for _ in range(2)]
    health = client.health()
    assert isinstance(health, Health) and health == Health(status="ok", version=hora.__version__)
    jobs, total = client.jobs(limit=1)
    raw = httpx.get(f"{server.url}/v1/jobs", params={"limit": 1}, headers=server.auth("ann"))
    page = JobList[JobInfo].model_validate(raw.json())
    assert (jobs, total) == (page.items, page.total) and total >= 2 and page.next_offset == 1
    assert all(type(j) is JobInfo for j in jobs) and jobs[0].id == done[-1].id
    assert jobs[0].model_dump(mode="json") == raw.json()["items"][0]  # every field kept


def test_client_reads_env_and_config(
    server: ServiceServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from hora.client import save_config

    monkeypatch.delenv("HORA_URL", raising=False)
    monkeypatch.delenv("HORA_TOKEN", raising=False)
    monkeypatch.setenv(
        "HORA_CONFIG", str(save_config(server.url, server.tokens["root"], tmp_path / "cfg"))
    )
    with hora.Client() as c:
        assert c.url == server.url and c.gpus()


def test_digits_example_as_two_worker_job(client: Client, tmp_path: Path) -> None:
    example = REPO / "examples" / "train_digits.py"
    if not example.exists():
        pytest.skip("examples/train_digits.py is not in this checkout yet")
    argv = [PY, str(example), "--epochs", "2", "--checkpoint-dir", str(tmp_path)]
    job = client.submit(argv, workers=2, name="digits", env={"OMP_NUM_THREADS": "1"})
    final = job.wait(timeout=200)
    log = job.logs(0)
    assert final.state.value == "succeeded", log[-3000:]
    assert "epoch 2/2" in log and "trained on 2 process(es)" in log
    assert re.search(r"final test accuracy: 0\.\d+", log)
    assert (tmp_path / "checkpoint.pt").exists()
