"""The queue view with 200 queued jobs costs a fixed number of store reads, not one per entry.

The red team's concern (issue 25, item 5): ``GET /ui/api/queue`` took up to 4.3 s with 200
queued jobs under load, because every entry read all users from the store (for its owner's
quota) and its own record. Timings are not asserted here (``bench/queue_view.py`` measures
them, in interleaved pairs); what made them grow is: a real job manager on a real SQLite
file, 200 jobs of two users queued (no scheduling pass runs), and the store's reads counted
while the view is built for an admin and for a user.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hora.spec import JobSpec
from hora_service.manager import JobManager
from hora_service.models import User
from hora_service.observability import queueview
from hora_service.settings import Settings
from hora_service.store.db import Store

QUEUED = 200


@pytest.fixture
def mgr(tmp_path: Path) -> JobManager:
    m = JobManager(Settings(data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=2))
    m.open_store()
    for i in range(QUEUED):
        m.submit("ann" if i % 2 else "bob", JobSpec(command=["python", "t.py"], workers=1 + i % 2))
    return m


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count every call of the store's methods that read (or write) the database."""
    calls: dict[str, int] = {}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kw: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kw)

        return counted

    for name, fn in list(vars(Store).items()):
        if callable(fn) and not name.startswith("__"):
            monkeypatch.setattr(Store, name, wrap(name, fn))
    return calls


def test_200_queued_jobs_are_shown_with_a_few_store_reads(
    mgr: JobManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    admin = User(id=1, name="root", is_admin=True)
    bob = User(id=2, name="bob", is_admin=False)
    calls = _counting(monkeypatch)
    shown = queueview.queue_entries(mgr, admin)
    assert len(shown) == QUEUED and [e.position for e in shown] == list(range(1, QUEUED + 1))
    assert all(e.reason is not None and e.kind == "job" and e.user for e in shown)
    assert calls.get("users", 0) == 1, calls  # the quotas: once per view, not per entry
    assert sum(calls.values()) <= 3, calls  # users, and the records not yet cached at once
    calls.clear()
    mine = queueview.queue_entries(mgr, bob)
    assert sum(e.id is not None for e in mine) == QUEUED // 2  # the others' only as places
    assert calls == {"users": 1}, calls  # every record now comes from the manager's cache
    assert len(queueview.entries_json(mine)) > 0
