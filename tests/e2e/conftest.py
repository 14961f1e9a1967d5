"""Fixtures shared by the e2e tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from _notebooks_procs import TAG_VAR, describe, kill_tagged, new_tag, wait_gone
from helpers.docker_engine import Engine, EngineUnavailable, cpu_image, engine


@pytest.fixture(scope="module", autouse=True)
def _module_leftovers(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every process a module starts carries its tag (``HORA_TEST_TAG``, unless a test gives
    its own); none may outlive the module's teardown, its fixtures' included.

    The in-process magics tests start kernel-local engines from the test process itself: this is
    what sees one they leave behind. It also keeps modules that run side by side (CI) apart.
    """
    tag = new_tag()
    before = os.environ.get(TAG_VAR)
    os.environ[TAG_VAR] = tag
    try:
        yield tag
    finally:
        if before is None:
            os.environ.pop(TAG_VAR, None)
        else:
            os.environ[TAG_VAR] = before
        left = wait_gone(tag, timeout=30)
        if left:
            what = describe(left)
            kill_tagged(tag)
            pytest.fail(f"{request.module.__name__} left processes running:\n{what}")


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
