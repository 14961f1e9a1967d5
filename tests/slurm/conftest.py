"""Fixtures of the slurm tests: one real two-node Slurm cluster for the whole session.

``notebook``: a real kernel (nbclient) with hora loaded, talking to the module's own
``server`` fixture as ann; at its end no process of its is left.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e._notebook import Notebook, hora_notebook
from helpers.service_server import ServiceServer
from helpers.slurm_cluster import Cluster, cluster, slurm_env


@pytest.fixture(scope="session")
def slurm() -> Iterator[Cluster]:
    """The CI's cluster (``HORA_TEST_SLURM_DIR``) or a private one (stopped and checked)."""
    with cluster() as made:
        yield made


@pytest.fixture(scope="session")
def service(slurm: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceServer]:
    tmp = tmp_path_factory.mktemp("slurm-service")
    with ServiceServer(tmp, env=slurm_env(slurm)) as srv:
        yield srv
    slurm.wait_idle()


@pytest.fixture
def ann(service: ServiceServer) -> Iterator[httpx.Client]:
    with service.client("ann") as c:
        yield c


@pytest.fixture
def notebook(server: ServiceServer, tmp_path: Path) -> Iterator[Notebook]:
    with hora_notebook(server, tmp_path) as nb:
        yield nb
