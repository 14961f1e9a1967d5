"""Recovery alone: given an EngineGroup and a restart callable, no cluster and no engines."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hora.engines.errors import RankDiedError
from hora.engines.group import Engine, EngineGroup
from hora.engines.plan import ClusterOptions
from hora.engines.recovery import Recovery
from hora.engines.state import ClusterState


class Proc:
    def __init__(self, pid: int, code: int | None = None) -> None:
        self.pid, self.code = pid, code

    def poll(self) -> int | None:
        return self.code


class Launcher:
    """The part of an EngineLauncher that Recovery's refusals touch."""

    workdir = None

    def __init__(self, cannot: str | None = None) -> None:
        self.cannot = cannot
        self.asked: list[list[int]] = []

    def after_death(self, dead: Sequence[int], procs: Sequence[Any]) -> str | None:
        self.asked.append(list(dead))
        return self.cannot


def _group(launcher: Launcher, codes: Sequence[int | None]) -> EngineGroup:
    group = EngineGroup(ClusterOptions(n=len(codes)), launcher)  # type: ignore[arg-type]
    group.engines = [
        Engine(r, r, b"", Proc(100 + r, c), "h", "cpu", "", Path("s"), Path("l"))
        for r, c in enumerate(codes)
    ]
    group.state = ClusterState.READY
    return group


def test_ranks_that_did_not_stop_restart_through_the_callable() -> None:
    calls: list[bool] = []
    rec = Recovery(_group(Launcher(), [None, None]), lambda: calls.append(True))
    out = rec.recover([1], forced=True)
    assert calls == [True]
    assert "rank 1 did not stop" in out and "restarted" in out


def test_a_failed_restart_marks_the_group_broken() -> None:
    def restart() -> None:
        raise RuntimeError("no controller")

    group = _group(Launcher(), [None, None])
    out = Recovery(group, restart).recover([0], forced=True)
    assert group.state is ClusterState.BROKEN
    assert "restart failed: no controller" in group.broken_reason
    assert "restarting the engines failed" in out


def test_a_death_the_launcher_cannot_replace_breaks_the_group() -> None:
    launcher = Launcher(cannot="the hora service ended session 3")
    group = _group(launcher, [None, 9])
    out = Recovery(group, lambda: None).after_death(RankDiedError({1: 9}))
    assert launcher.asked == [[1]]
    assert group.state is ClusterState.BROKEN
    assert group.broken_reason == "the hora service ended session 3"
    assert out.startswith("the hora service ended session 3; ")


def test_repair_is_quiet_while_every_engine_lives() -> None:
    group = _group(Launcher(), [None, None])
    assert Recovery(group, lambda: None).repair() == ""
    assert group.state is ClusterState.READY
