"""The store's job counts: a list's total and the metrics' counts without reading every job.

``job_counts`` is kept by triggers in the writing transaction; these tests check it against
a count of the rows themselves after every kind of write, after a migration of a store that
already holds jobs, and that the queries of a list and of the metrics never scan the jobs
table (a real SQLite file, its own query plans; no timings).
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest
from hora.spec import JobSpec, JobState
from hora_service.store.db import MIGRATIONS, SCHEMA_VERSION, Store, token_hash
from sqlalchemy import event

USERS = ("ann", "bob", "cy")
STATES = list(JobState)


def _truth(db: Path, user: str | None, state: JobState | None, hidden: set[int]) -> int:
    """How many jobs match, counted from the rows (as the store counted before v10)."""
    where, params = ["1"], {}
    if user is not None:
        where.append("user = :u AND user_id IS (SELECT id FROM users WHERE name = :u)")
        params["u"] = user
    if state is not None:
        where.append("state = :s")
        params["s"] = state.value
    with sqlite3.connect(db) as c:
        ids = [r[0] for r in c.execute(f"SELECT id FROM jobs WHERE {' AND '.join(where)}", params)]
    return len([i for i in ids if i not in hidden])


def _check(store: Store, hidden: set[int]) -> None:
    for user in (None, *USERS, "nobody"):
        for state in (None, *STATES):
            ids, total = store.list_ids(user, state, 5, 0, hidden)
            assert total == _truth(store.path, user, state, hidden), (user, state)
            assert not set(ids) & hidden and ids == sorted(ids, reverse=True)
    with sqlite3.connect(store.path) as c:
        by_state = dict(c.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())
    assert store.count_by_state() == by_state


def test_counts_follow_inserts_moves_deletes_and_users(tmp_path: Path) -> None:
    store = Store(tmp_path / "hora.db")
    for name in USERS:
        store.add_user(name, token_hash(name))
    rng = random.Random(7)
    ids: list[int] = []
    hidden: set[int] = set()
    for step in range(120):
        op = rng.random()
        if op < 0.45 or not ids:
            with store.tx() as conn:
                ids.append(store.insert_job(conn, rng.choice(USERS), JobSpec(command=["x"]), 1.0))
        elif op < 0.8:
            with store.tx() as conn:
                store.update_job(conn, rng.choice(ids), state=rng.choice(STATES), attempt=step)
        elif op < 0.9:
            gone = ids.pop(rng.randrange(len(ids)))
            store.delete_job(gone)
            hidden.discard(gone)
        else:
            hidden.add(rng.choice(ids))
        if step % 10 == 0:
            _check(store, hidden)
    # a removed user's jobs stay theirs, not a new user's of the same name
    store.remove_user("bob")
    store.add_user("bob", token_hash("bob2"))
    with store.tx() as conn:
        ids.append(store.insert_job(conn, "bob", JobSpec(command=["x"]), 2.0))
    _check(store, hidden)
    assert store.list_ids("bob", None, 50, 0)[1] == 1
    store.close()


def test_a_store_with_jobs_is_counted_when_it_migrates(tmp_path: Path) -> None:
    db = tmp_path / "hora.db"
    conn = sqlite3.connect(db)
    for version in range(SCHEMA_VERSION - 1):
        for statement in MIGRATIONS[version]:
            conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION - 1}")
    conn.execute("INSERT INTO users (name, token_hash, created_at) VALUES ('ann', 'h', 0)")
    conn.execute("INSERT INTO users (name, token_hash, created_at) VALUES ('bob', 'i', 0)")
    for i, (user, state) in enumerate([("ann", "succeeded")] * 3 + [("bob", "queued")] * 2):
        conn.execute(
            "INSERT INTO jobs (user, user_id, spec, state, priority, need, created_at) VALUES "
            "(?, (SELECT id FROM users WHERE name = ?), '{}', ?, 1, 1, ?)",
            (user, user, state, float(i)),
        )
    conn.commit()
    conn.close()
    store = Store(db)
    assert store.count_by_state() == {"succeeded": 3, "queued": 2}
    assert store.list_ids("ann", None, 50, 0)[1] == 3
    assert store.list_ids("bob", JobState.queued, 1, 0) == ([5], 2)
    _check(store, set())
    store.close()


@pytest.mark.parametrize("user", [None, "ann"])
@pytest.mark.parametrize("state", [None, JobState.queued])
def test_a_list_and_the_metrics_never_scan_every_job(
    tmp_path: Path, user: str | None, state: JobState | None
) -> None:
    store = Store(tmp_path / "hora.db")
    for name in USERS:
        store.add_user(name, token_hash(name))
    with store.tx() as conn:
        for i in range(30):
            store.insert_job(conn, USERS[i % 3], JobSpec(command=["x"]), float(i))
    seen: list[tuple[str, object]] = []  # each statement as SQLite got it, with its values
    event.listen(store.engine, "before_cursor_execute", lambda *a: seen.append((a[2], a[3])))
    store.list_ids(user, state, 10, 0, hidden={3, 4})
    store.count_by_state()
    counting = [s for s in seen if "ORDER BY id DESC LIMIT" not in s[0]]  # the page reads 10
    assert counting
    with store.engine.connect() as conn:
        for sql, params in counting:
            plan = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}", params).all()  # type: ignore[arg-type]
            # job_counts is scanned (a row per owner and state); the jobs never are
            scans = [row[-1] for row in plan if str(row[-1]).startswith("SCAN jobs")]
            assert not scans, (sql, scans)
    store.close()
