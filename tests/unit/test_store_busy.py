"""The store's write transactions wait for SQLite's lock only as long as asked, then restore.

:meth:`hora_service.store.db.Store.tx` sets the connection's busy timeout to its own for the
transaction (SQLite's own call), and back to the store's default after it, so that a pooled
connection a reader gets next waits as long as before. Real SQLite files.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hora_service.store.db import Store, _busy_timeout
from hora_service.store.sqlite import BUSY_TIMEOUT_MS
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, OperationalError


def busy(conn: Connection) -> int:
    return int(conn.exec_driver_sql("PRAGMA busy_timeout").scalar() or 0)


def test_a_transaction_waits_its_own_timeout_and_restores_the_default(tmp_path: Path) -> None:
    store = Store(tmp_path / "hora.db")
    with store.tx(0.25) as conn:
        assert busy(conn) == 250
        used = conn.connection.driver_connection
    with store.engine.connect() as conn:  # the same pooled connection, as a reader gets it
        assert conn.connection.driver_connection is used
        assert busy(conn) == BUSY_TIMEOUT_MS
    with store.tx() as conn:  # no timeout asked: the default
        assert busy(conn) == BUSY_TIMEOUT_MS


def test_a_write_another_process_locks_out_fails_after_the_timeout(tmp_path: Path) -> None:
    store = Store(tmp_path / "hora.db")
    other = sqlite3.connect(tmp_path / "hora.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # holds SQLite's write lock
    try:
        with pytest.raises(OperationalError, match="locked"), store.tx(0.2) as conn:
            conn.exec_driver_sql("CREATE TABLE probe (x)")
    finally:
        other.execute("ROLLBACK")
        other.close()
    with store.engine.connect() as conn:
        assert busy(conn) == BUSY_TIMEOUT_MS
    with store.tx(0.2) as conn:  # the lock is free again: the same write lands
        conn.exec_driver_sql("CREATE TABLE probe (x)")


def test_a_connection_sqlite_refuses_raises_sqlalchemys_error(tmp_path: Path) -> None:
    store = Store(tmp_path / "hora.db")
    with store.engine.connect() as conn:
        conn.connection.driver_connection.close()  # type: ignore[union-attr]
        with pytest.raises(DBAPIError) as e:  # not sqlite3's own: callers know this one
            _busy_timeout(conn, 250)
        assert isinstance(e.value.orig, sqlite3.ProgrammingError)
        conn.invalidate()
    with store.tx(0.25) as conn:  # the pool replaces the closed connection
        assert busy(conn) == 250
