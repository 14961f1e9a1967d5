"""The cached answer of GET /v1/session-address?runtime=slurm
(hora_service.runtimes.slurm_route)."""

from __future__ import annotations

import threading
import time

import pytest
from hora.errors import SpecError
from hora_service.runtimes import slurm_route
from hora_service.runtimes.slurm import NodeRouteError
from hora_service.runtimes.slurm_route import NodeRoute


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_address_is_asked_once_until_it_is_old() -> None:
    asked: list[float] = []
    clock = Clock()
    route = NodeRoute(lambda: asked.append(clock.now) or ("n1", "10.0.0.5"), clock)
    assert [route.get() for _ in range(3)] == [("n1", "10.0.0.5")] * 3
    clock.now = slurm_route.FOUND_S - 1
    route.get()
    assert asked == [0.0]
    clock.now = slurm_route.FOUND_S
    route.get()
    assert asked == [0.0, slurm_route.FOUND_S]


def test_a_failure_is_kept_briefly_and_said_without_the_tools_words() -> None:
    asked: list[float] = []
    clock = Clock()

    def ask() -> tuple[str, str]:
        asked.append(clock.now)
        raise NodeRouteError("Slurm's scontrol listed no node", "slurm_load_node error: boom")

    route = NodeRoute(ask, clock)
    for _ in range(3):
        with pytest.raises(SpecError) as e:
            route.get()
        assert e.value.field == "runtime"
        assert "listed no node" in str(e.value) and "HORA_SLURM_SESSION_ADDRESS" in str(e.value)
        assert "slurm_load_node" not in str(e.value) and "boom" not in str(e.value)
    clock.now = slurm_route.FAILED_S
    with pytest.raises(SpecError):
        route.get()
    assert asked == [0.0, slurm_route.FAILED_S]


def test_requests_at_once_run_one_ask() -> None:
    asked: list[int] = []

    def ask() -> tuple[str, str]:
        asked.append(1)
        time.sleep(0.2)
        return "n1", "10.0.0.5"

    route = NodeRoute(ask)
    answers: list[tuple[str, str]] = []
    threads = [threading.Thread(target=lambda: answers.append(route.get())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert answers == [("n1", "10.0.0.5")] * 8 and asked == [1]
