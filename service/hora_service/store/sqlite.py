"""How the store's SQLite file and connections are set up (control plane).

The database file is the service's alone (mode 0600, its WAL files too); every connection
runs in WAL mode with foreign keys and a busy timeout; a connection that met a damaged file
is dropped rather than reused. :class:`hora_service.store.db.Store` wires these in.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

BUSY_TIMEOUT_MS = 30_000


def owner_only(path: Path) -> None:
    """Create the database file readable and writable by the service's account only.

    SQLite gives its ``-wal`` and ``-shm`` files the database file's mode.
    """
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if f.exists():
            f.chmod(0o600)


def drop_broken(ctx: Any) -> None:
    """A connection that met a damaged file is dropped (with the pool), not reused.

    SQLite keeps answering "file is not a database" on a connection that once read a damaged
    header, even after the file is repaired; new connections read it afresh.
    """
    orig = ctx.original_exception
    if isinstance(orig, sqlite3.DatabaseError) and type(orig) is sqlite3.DatabaseError:
        ctx.is_disconnect = True


def pragmas(dbapi_conn: Any, record: Any) -> None:
    """Every new connection: WAL, NORMAL sync, foreign keys, and a busy timeout."""
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cur.close()
