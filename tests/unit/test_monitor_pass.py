"""One monitor pass reads what it needs once: the users' quotas (a real SQLite store).

The scheduling pass, the shrink check and every hook of a pass ask for quotas; the users are
read once a pass, and each pass (and each request) reads them afresh, so a quota changed
between passes is seen by the next one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hora_service.manager import JobManager
from hora_service.settings import Settings
from sqlalchemy import text


@pytest.fixture
def mgr(tmp_path: Path) -> JobManager:
    settings = Settings(data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=2)
    m = JobManager(settings)
    m.open_store()
    return m


def test_a_pass_reads_the_users_once_and_the_next_pass_afresh(mgr: JobManager) -> None:
    mgr.users.create("ann", quota=1)
    store = mgr.open_store()
    reads: list[int] = []
    real = store.users

    def counted() -> list:  # type: ignore[type-arg]
        reads.append(1)
        return real()

    store.users = counted  # type: ignore[method-assign]
    seen: list[int | None] = []
    mgr.hooks.append(lambda now: seen.extend(mgr.quota_of("ann") for _ in range(3)))
    mgr.tick()
    assert seen == [1, 1, 1] and len(reads) == 1
    assert mgr.quota_of("ann") == 1 and mgr.quota_of("ann") == 1  # a request reads afresh
    assert len(reads) == 3
    with store.tx() as conn:
        conn.execute(text("UPDATE users SET gpu_quota = 2 WHERE name = 'ann'"))
    mgr.tick()
    assert seen[3:] == [2, 2, 2] and len(reads) == 4
