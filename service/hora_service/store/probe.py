"""The store check behind ``/healthz`` (control plane).

A background thread looks at the store every ``interval_s`` seconds, on its own SQLite
connection, and keeps the answer; ``/healthz`` only reads that answer, so it stays fast when
the store is slow or blocked (a route that waited on SQLite would freeze with it). The
service is ``degraded`` when

* job state changes wait in the manager's journal (the store refused them),
* the database cannot be read (locked for readers past a second, corrupted, missing),
* another process holds the write lock past a second, or
* the data directory's disk is full;

otherwise ``ok``. The reason says which.

Example:
    >>> probe = StoreProbe(Path("/nonexistent/hora.db"), Journal(), interval_s=60)
    >>> probe.check().status
    'degraded'
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hora_service.store.journal import Journal

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
MIN_FREE_BYTES = 1 << 20


@dataclass(frozen=True)
class HealthState:
    """One answer of the probe: ``ok`` or ``degraded`` and why, and when it was taken."""

    status: str
    reason: str | None = None
    checked_at: float = 0.0

    @property
    def ok(self) -> bool:
        """True when nothing is wrong."""
        return self.status == "ok"


class StoreProbe:
    """Checks the store in the background (see the module docstring).

    Args:
        db_path: the SQLite file.
        journal: the manager's journal of changes the store has not taken.
        interval_s: seconds between two checks.
    """

    def __init__(self, db_path: Path, journal: Journal, interval_s: float = 2.0) -> None:
        self.db_path = db_path
        self.journal = journal
        self.interval_s = interval_s
        self.state = HealthState("ok", None, time.time())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Check once now, then every ``interval_s`` in a daemon thread."""
        self.state = self.check()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="hora-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (it ends within one check)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                state = self.check()
            except Exception as e:  # the probe must outlive any one bad check
                state = HealthState("degraded", f"the store check failed: {e}", time.time())
            if state.reason != self.state.reason:
                level = logging.INFO if state.ok else logging.WARNING
                log.log(level, "health: %s (%s)", state.status, state.reason or "the store is fine")
            self.state = state

    def check(self) -> HealthState:
        """One look at the store; see the module docstring for what makes it degraded."""
        now = time.time()
        reason = (
            self._journal_reason(now)
            or _store_reason(self.db_path)
            or _disk_reason(self.db_path.parent)
        )
        return HealthState("ok" if reason is None else "degraded", reason, now)

    def _journal_reason(self, now: float) -> str | None:
        waiting = len(self.journal)
        if not waiting:
            return None
        since = self.journal.failing_since or now
        return (
            f"{waiting} job state change(s) have waited {now - since:.0f}s for the store: "
            f"{self.journal.error}"
        )


def _store_reason(db_path: Path) -> str | None:
    """Why the database cannot be read or written now, or None."""
    if not db_path.exists():
        return f"the store {db_path} is missing"
    try:
        conn = sqlite3.connect(f"file:{db_path}?mode=rw", uri=True, timeout=PROBE_TIMEOUT_S)
    except sqlite3.Error as e:
        return f"the store cannot be opened: {e}"
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        conn.execute("SELECT id FROM jobs ORDER BY id DESC LIMIT 1").fetchone()
        conn.execute("SELECT id FROM users ORDER BY id LIMIT 1").fetchone()
    except sqlite3.Error as e:
        return f"the store cannot be read: {e}"
    try:
        conn.execute("BEGIN IMMEDIATE")  # is the write lock free? taken and given back at once
        conn.execute("ROLLBACK")
    except sqlite3.OperationalError as e:
        return f"the store cannot take writes: {e}"
    finally:
        conn.close()
    return None


def _disk_reason(data_dir: Path) -> str | None:
    try:
        free = shutil.disk_usage(data_dir).free
    except OSError as e:
        return f"cannot look at the data directory {data_dir}: {e}"
    if free < MIN_FREE_BYTES:
        return f"the disk of {data_dir} is full ({free} bytes free)"
    return None
