"""What ``%dist_start``'s line turns into, and what the magics show of it (no engines started).

:mod:`hora.magics_start` makes the engines' options and the :class:`StartMode` from the
parsed line, each bad value one :class:`UsageError` naming the flag; ``%dist_start``'s table
shows the cluster's typed rows in its own column order; a parked-session listing asks the
configured service even while kernel-local engines (which hold no service client) are up.
"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
from hora import magics_park
from hora.client import ServiceUnavailable
from hora.engines import Cluster, ClusterOptions
from hora.engines.cluster import EngineRow
from hora.magics_display import engines_table
from hora.magics_start import StartMode, cluster_options, start_mode
from hora.net import free_port
from IPython.core.error import UsageError


def line(**given: Any) -> Namespace:
    """``%dist_start``'s parsed arguments: its defaults, then ``given``."""
    args = dict(n=None, gpus=None, backend=None, timeout=None, start_timeout=60.0, local=False,
                idle_timeout=None, runtime="local", ip=None, image=None)  # fmt: skip
    return Namespace(**(args | given))


def test_the_default_line_starts_local_engines_or_a_session() -> None:
    assert start_mode(line()) == StartMode()
    assert cluster_options(line()) == ClusterOptions(timeout_s=60.0, start_timeout_s=60.0)


def test_each_flag_lands_in_its_field() -> None:
    mode = start_mode(line(local=True, idle_timeout=30.0, runtime="slurm", ip="10.0.0.5"))
    assert mode == StartMode(local=True, idle_timeout_s=30.0, runtime="slurm", ip="10.0.0.5")
    docker = start_mode(line(runtime="docker", image="hora:cpu"))
    assert (docker.runtime, docker.image, docker.ip) == ("docker", "hora:cpu", None)
    options = cluster_options(line(n=3, gpus=" 0, 2,,5 ", backend="gloo", timeout=9.0,
                                   start_timeout=20.0))  # fmt: skip
    assert options == ClusterOptions(n=3, gpus=("0", "2", "5"), backend="gloo", timeout_s=9.0,
                                     start_timeout_s=20.0)  # fmt: skip


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"ip": "10.0.0.5"}, "--ip is for --runtime slurm (local engines use 127.0.0.1)"),
        ({"image": "hora:cpu"}, "--image goes with --runtime docker, which needs one (with hora)"),
        ({"runtime": "docker"}, "--image goes with --runtime docker, which needs one (with hora)"),
    ],
)
def test_a_mode_that_cannot_start_is_one_usage_error(given: dict[str, str], message: str) -> None:
    with pytest.raises(UsageError) as e:
        start_mode(line(**given))
    assert str(e.value) == message


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"gpus": " , "}, "--gpus expects a comma-separated list such as 0,1; got ' , '"),
        ({"n": 0}, "n: number of engines must be >= 1, got 0"),
        ({"backend": "mpi"}, "backend: must be nccl or gloo, got 'mpi'"),
        ({"timeout": -1.0}, "timeout: must be > 0 seconds, got -1"),
    ],
)
def test_bad_options_are_one_usage_error_naming_the_flag(given: dict[str, Any],
                                                         message: str) -> None:  # fmt: skip
    with pytest.raises(UsageError) as e:
        cluster_options(line(**given))
    assert str(e.value) == message


def test_the_start_table_shows_the_cluster_s_rows_in_its_own_order() -> None:
    rows = [EngineRow(rank=r, engine_id=7 - r, host="h", pid=100 + r, device="cpu", gpu="-")
            for r in (0, 1)]  # fmt: skip
    table = engines_table(rows, "2 engines ready")
    assert table.cols == ["rank", "host", "pid", "device", "gpu", "engine_id"]
    assert repr(table).splitlines()[-1].split() == ["1", "h", "101", "cpu", "-", "6"]


def test_listing_parked_sessions_beside_kernel_local_engines_asks_the_configured_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the ask must name this URL
    monkeypatch.setenv("HORA_URL", url)
    monkeypatch.setenv("HORA_TOKEN", "t")
    local = Cluster(ClusterOptions(n=1))  # its launcher has no service client
    with pytest.raises(ServiceUnavailable) as e:
        magics_park.parked_sessions(local)
    assert e.value.url == f"{url}/v1/sessions"


def test_the_magics_type_their_boundary_without_any() -> None:
    import ast

    import hora.magics

    tree = ast.parse(Path(hora.magics.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "Any" not in names  # the shell, cluster, options, mode and records have real types
