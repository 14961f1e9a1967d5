"""One monitor pass reads what it needs once: the users' quotas (a real SQLite store).

The scheduling pass, the shrink check and every hook of a pass ask for quotas; the users are
read once a pass, and each pass (and each request) reads them afresh, so a quota changed
between passes is seen by the next one.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hora_service.manager import JobManager
from hora_service.settings import Settings
from hora_service.store.db import Store
from sqlalchemy import text


@pytest.fixture
def mgr(tmp_path: Path) -> JobManager:
    settings = Settings(data_dir=tmp_path / "data", work_root=tmp_path, gpus="0", cpu_slots=2)
    m = JobManager(settings)
    m.open_store()
    return m


def _counted_user_reads(store: Store) -> list[int]:
    """One entry appended for each read of the users that ``store`` serves from now on."""
    reads: list[int] = []
    real = store.users

    def counted() -> list:  # type: ignore[type-arg]
        reads.append(1)
        return real()

    store.users = counted  # type: ignore[method-assign]
    return reads


def test_a_pass_reads_the_users_once_and_the_next_pass_afresh(mgr: JobManager) -> None:
    mgr.users.create("ann", quota=1)
    store = mgr.open_store()
    reads = _counted_user_reads(store)
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


def test_a_pass_with_no_free_slot_reads_no_user(tmp_path: Path) -> None:
    # every slot is held by another holder on the machine (real forked lease holders): nothing
    # can start, so the pass does not pay for the users' quotas under the manager's lock
    from helpers.lease_holder import Holder
    from hora.leases import LeaseDir
    from hora.spec import JobSpec

    settings = Settings(
        data_dir=tmp_path / "data", work_root=tmp_path, gpus="0,1", lease_dir=tmp_path / "l"
    )
    m = JobManager(settings)
    store = m.open_store()
    m.users.create("ann")
    machine = LeaseDir(tmp_path / "l")
    machine.ready()
    holders = [Holder(machine, m.leases.name(s.index)) for s in m.inventory]
    try:
        assert all(h.took for h in holders)
        job = m.submit("ann", JobSpec(command=["true"], workers=2))
        reads = _counted_user_reads(store)
        with m.state.lock:
            m.monitor.schedule(time.time())
        assert reads == [] and job.id in m.state.pending
        holders.pop().kill()  # one slot frees: the job (2 workers) still cannot start
        with m.state.lock:
            m.monitor.schedule(time.time())
        assert reads == [1] and job.id in m.state.pending
    finally:
        for h in holders:
            h.kill()
        m.close_store()
