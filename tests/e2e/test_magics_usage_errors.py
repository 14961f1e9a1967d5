"""A usage error in a magic shows one line, never a traceback through hora's own frames.

A real service (2 CPU slots) on 127.0.0.1 and an IPython shell in this process with
``HORA_URL``/``HORA_TOKEN`` set, as a notebook kernel configured for the service has them:
``%%distributed -n 99`` and ``%dist_start -n 99`` ask the service for 99 engines, which it
refuses as invalid (422). The notebook must show the service's sentence, and only it: no
"Traceback", no file of hora's, no URL or status. A service that cannot be reached is said
the same way (``%dist_start --runtime slurm`` needs one). No engine is started by any of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.service_server import ServiceServer
from hora.client import ServiceError, ServiceUnavailable
from hora.net import free_port
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

pytestmark = pytest.mark.timeout(120)

REFUSED = "ServiceError: workers: asks for 99 slots (99 workers x 1); this cluster has 2\n"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    with ServiceServer(tmp_path_factory.mktemp("usage"), users={"ann": False},
                       cpu_slots=2) as server:
        yield server


@pytest.fixture
def ip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[InteractiveShell]:
    monkeypatch.setenv("HORA_CONFIG", str(tmp_path / "no-config"))
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "hora")
    yield shell
    shell.run_line_magic("unload_ext", "hora")


def _shown(ip: InteractiveShell, cell: str) -> tuple[BaseException | None, str]:
    with capture_output() as cap:
        result = ip.run_cell(cell)
    return result.error_in_exec, cap.stdout + cap.stderr


def _one_line(shown: str) -> None:
    assert "Traceback" not in shown and "File " not in shown and ".py" not in shown, shown
    assert shown.count("\n") == 1, shown


@pytest.mark.parametrize("cell", ["%%distributed -n 99\nprint(1)", "%dist_start -n 99"])
def test_asking_for_more_engines_than_slots_is_one_sentence(
    srv: ServiceServer, ip: InteractiveShell, monkeypatch: pytest.MonkeyPatch, cell: str
) -> None:
    monkeypatch.setenv("HORA_URL", srv.url)
    monkeypatch.setenv("HORA_TOKEN", srv.tokens["ann"])
    error, shown = _shown(ip, cell)
    assert isinstance(error, ServiceError) and error.status == 422
    assert shown == REFUSED
    _one_line(shown)


def test_a_service_that_cannot_be_reached_is_one_sentence(
    ip: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("HORA_URL", url)
    monkeypatch.setenv("HORA_TOKEN", "t")
    error, shown = _shown(ip, "%dist_start -n 1 --runtime slurm")
    assert isinstance(error, ServiceUnavailable)
    assert shown.startswith(f"ServiceUnavailable: cannot reach the hora service at {url}")
    _one_line(shown)
