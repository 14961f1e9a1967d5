"""Fixtures shared by the e2e tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers.docker_engine import Engine, EngineUnavailable, cpu_image, engine


@pytest.fixture(scope="module")
def docker_engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    """The Docker engine (:func:`helpers.docker_engine.engine`) with ``hora:cpu`` built.

    No engine is a failure, never a skip. A module that sets ``DOCKER_NONE_LEFT = True``
    also fails if containers of hora's are left on the engine at its end.
    """
    try:
        with engine() as eng:
            cpu_image(eng)
            # an engine that outlived an earlier run (a developer's, or a rehearsal's) may hold
            # its exited containers, labelled with the same job ids this module's service uses
            stale = eng.remove_stopped_hora_containers()
            if stale:
                print(f"removed containers left on the engine by an earlier run: {stale}")
            yield eng
            if getattr(request.module, "DOCKER_NONE_LEFT", False):
                left = eng.hora_containers()
                assert not left, f"containers left after {request.module.__name__}: {left}"
    except EngineUnavailable as e:
        pytest.fail(f"no Docker engine for {request.module.__name__}: {e}")
