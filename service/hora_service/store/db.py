"""The SQLite store of the job service (control plane): users, jobs, transitions.

SQLAlchemy 2 over one SQLite file in WAL mode (readers never wait for the writer). The
schema is versioned with ``PRAGMA user_version`` and upgraded by :data:`MIGRATIONS`
(:mod:`hora_service.store.schema`) when the store opens, in one transaction per step, so an
old data directory keeps working.

Times are stored as UNIX seconds (REAL) and returned as aware UTC datetimes. Tokens are
stored only as SHA-256 hex digests.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hora.errors import HoraError
from hora.spec import PRIORITY_RANK, ElasticInfo, JobKind, JobSpec, JobState, ParkInfo
from pydantic import BaseModel
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.exc import (
    DatabaseError,
    IntegrityError,
    OperationalError,
    ProgrammingError,
    SQLAlchemyError,
)

from hora_service.models import JobRecord, Transition, User
from hora_service.store.schema import MIGRATIONS, SCHEMA_VERSION
from hora_service.store.sqlite import BUSY_TIMEOUT_MS, drop_broken, owner_only, pragmas

ACTIVE = (JobState.starting, JobState.running)
JOB_COLUMNS = (
    "id, user, spec, state, attempt, reason, exit_codes, slots, created_at, started_at, "
    "finished_at, user_id, kind, container_id, elastic, park"
)
USER_COLUMNS = "id, name, is_admin, gpu_quota, os_uid, idle_timeout_s, limits"
# the id of the user who has this name now (jobs belong to ids, requests come with names)
USER_ID = "(SELECT id FROM users WHERE name = :u)"
# jobs of the user who has the name :u now (NULL-safe: jobs of a name no user has, in tests)
OWNED_BY = f"user = :u AND user_id IS {USER_ID}"
# a session deleted by its owner loses its terms at once, its row once its engines are gone
DROPPED = "kind = 'session' AND id NOT IN (SELECT job_id FROM sessions)"


class StoreError(HoraError):
    """The store refused an operation (a duplicate user, a newer schema than this hora)."""


class StoreUnavailable(HoraError):
    """The store cannot take a write now (its lock is held, the disk is full, an I/O error).

    Attributes:
        retry_after_s: when it is worth trying again, in seconds.
    """

    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# SQLite's answers that say "not now" or "not this file" rather than "this request is wrong"
UNAVAILABLE = (OperationalError, DatabaseError, OSError)


def is_unavailable(exc: BaseException) -> bool:
    """True when ``exc`` is the store failing (locked, full, I/O, corrupt), not a bad request.

    Example:
        >>> is_unavailable(OperationalError("INSERT", {}, Exception("database is locked")))
        True
    """
    if isinstance(exc, StoreUnavailable):
        return True
    if isinstance(exc, IntegrityError | ProgrammingError):
        return False
    return isinstance(exc, UNAVAILABLE)


def token_hash(token: str) -> str:
    """SHA-256 hex digest of a token: what the store keeps instead of the token."""
    return hashlib.sha256(token.encode()).hexdigest()


def _utc(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def _busy_timeout(conn: Connection, ms: int) -> None:
    """Set the connection's busy timeout (SQLite's own call: a tenth of SQLAlchemy's cost).

    Should SQLite refuse, the statement goes through SQLAlchemy, which raises its own error.
    """
    statement = f"PRAGMA busy_timeout={ms}"
    try:
        conn.connection.driver_connection.execute(statement)  # type: ignore[union-attr]
    except sqlite3.Error:
        conn.exec_driver_sql(statement)


class Store:
    """Users and jobs in one SQLite file (see the module docstring).

    Args:
        path: the database file; its directory is created.

    Example:
        >>> store = Store(tmp_path / "hora.db")  # doctest: +SKIP
        >>> store.add_user("ann", token_hash("secret"))  # doctest: +SKIP
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        owner_only(path)
        self.engine: Engine = create_engine(
            f"sqlite:///{path}",
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=8,
            max_overflow=56,
            pool_timeout=30,
        )
        event.listen(self.engine, "connect", pragmas)
        event.listen(self.engine, "handle_error", drop_broken)
        self._write = threading.Lock()
        self.migrate()

    def close(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    @contextmanager
    def tx(self, timeout_s: float | None = None) -> Iterator[Connection]:
        """A write transaction; writers are serialised here rather than by SQLite's retry.

        Args:
            timeout_s: most seconds to wait for the write lock (this process's, then
                SQLite's); None waits for SQLite's busy timeout (30 s).

        Raises:
            StoreUnavailable: another write of this process held the lock for ``timeout_s``.
            sqlalchemy.exc.OperationalError: SQLite's lock stayed held, the disk is full, ...
        """
        if not self._write.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise StoreUnavailable(f"the job store was busy for {timeout_s:g}s")
        try:
            with self.engine.begin() as conn:
                if timeout_s is None:
                    yield conn
                    return
                _busy_timeout(conn, int(timeout_s * 1000))
                try:
                    yield conn
                finally:
                    # a connection-level setting; on a connection already dropped there is
                    # nothing to set (and the first error is the one to report)
                    with suppress(SQLAlchemyError):
                        _busy_timeout(conn, BUSY_TIMEOUT_MS)
        finally:
            self._write.release()

    def migrate(self) -> int:
        """Upgrade the schema to :data:`SCHEMA_VERSION`; return the version found before.

        Raises:
            StoreError: the file was written by a newer hora (a higher version).
        """
        with self.tx() as conn:
            found = int(conn.exec_driver_sql("PRAGMA user_version").scalar() or 0)
            if found > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has schema version {found}; this hora knows up to "
                    f"{SCHEMA_VERSION}: upgrade hora"
                )
            for version in range(found, SCHEMA_VERSION):
                for statement in MIGRATIONS[version]:
                    conn.exec_driver_sql(statement)
                conn.exec_driver_sql(f"PRAGMA user_version = {version + 1}")
        return found

    # users ------------------------------------------------------------------------------

    def add_user(
        self,
        name: str,
        digest: str,
        admin: bool = False,
        quota: int | None = None,
        os_uid: int | None = None,
        idle_timeout_s: float | None = None,
    ) -> User:
        """Create a user with a token digest (and the OS account their jobs run as).

        Raises:
            StoreError: the name is taken, or the OS account is another user's.
        """
        with self.tx() as conn:
            if conn.execute(text("SELECT 1 FROM users WHERE name = :n"), {"n": name}).first():
                raise StoreError(f"user {name!r} exists already")
            if os_uid is not None:
                other = conn.execute(
                    text("SELECT name FROM users WHERE os_uid = :o"), {"o": os_uid}
                ).first()
                if other is not None:
                    raise StoreError(f"uid {os_uid} already runs the jobs of user {other[0]!r}")
            row = conn.execute(
                text(
                    "INSERT INTO users "
                    "(name, token_hash, is_admin, gpu_quota, os_uid, idle_timeout_s, created_at) "
                    "VALUES (:n, :h, :a, :q, :o, :i, :t) RETURNING id"
                ),
                {
                    "n": name, "h": digest, "a": int(admin), "q": quota, "o": os_uid,
                    "i": idle_timeout_s, "t": _now(),
                },  # fmt: skip
            ).one()
        return User(
            id=int(row[0]), name=name, is_admin=admin, gpu_quota=quota, os_uid=os_uid,
            idle_timeout_s=idle_timeout_s,
        )  # fmt: skip

    def set_idle_timeout(self, name: str, idle_timeout_s: float | None) -> bool:
        """Set (None: clear) the idle timeout of a user's new sessions; False if no such user."""
        with self.tx() as conn:
            return bool(
                conn.execute(
                    text("UPDATE users SET idle_timeout_s = :i WHERE name = :n"),
                    {"i": idle_timeout_s, "n": name},
                ).rowcount
            )

    def set_limits(self, name: str, limits: dict[str, str]) -> bool:
        """Replace a user's own job limits (kind -> value as written); False if no such user."""
        with self.tx() as conn:
            return bool(
                conn.execute(
                    text("UPDATE users SET limits = :l WHERE name = :n"),
                    {"l": json.dumps(limits, sort_keys=True), "n": name},
                ).rowcount
            )

    def remove_user(self, name: str) -> bool:
        """Delete a user; False if there was none.

        Their jobs stay, owned by the old user's id, which no later user gets (a new user
        of the same name does not see them); their submission ids are released.
        """
        with self.tx() as conn:
            conn.execute(
                text(f"UPDATE jobs SET submission_id = NULL WHERE {OWNED_BY}"), {"u": name}
            )
            return bool(
                conn.execute(text("DELETE FROM users WHERE name = :n"), {"n": name}).rowcount
            )

    def user_by_digest(self, digest: str) -> User | None:
        """The user whose token has this digest."""
        return self._user("token_hash = :h", {"h": digest})

    def user_by_id(self, user_id: int) -> User | None:
        """The user with this id (None once removed)."""
        return self._user("id = :i", {"i": user_id})

    def user_by_name(self, name: str) -> User | None:
        """The user who has this name now."""
        return self._user("name = :n", {"n": name})

    def users(self) -> list[User]:
        """Every user, by name."""
        with self.engine.connect() as conn:
            rows = conn.execute(text(f"SELECT {USER_COLUMNS} FROM users ORDER BY name"))
            return [_user(r) for r in rows]

    def _user(self, where: str, params: dict[str, object]) -> User | None:
        with self.engine.connect() as conn:
            row = conn.execute(text(f"SELECT {USER_COLUMNS} FROM users WHERE {where}"), params)
            found = row.first()
        return None if found is None else _user(found)

    # jobs -------------------------------------------------------------------------------

    def insert_job(
        self, conn: Connection, user: str, spec: JobSpec, at: float, kind: JobKind = JobKind.job,
        note: str | None = None,
    ) -> int:  # fmt: skip
        """Insert a queued job (or session) with its first transition (``note``: its reason)."""
        row = conn.execute(
            text(
                "INSERT INTO jobs "
                "(user, user_id, submission_id, spec, state, priority, need, created_at, kind) "
                f"VALUES (:u, {USER_ID}, :sid, :spec, :st, :p, :need, :t, :kind) RETURNING id"
            ),
            {
                "kind": kind,
                "u": user,
                "sid": spec.submission_id,
                "spec": spec.model_dump_json(),
                "st": JobState.queued.value,
                "p": PRIORITY_RANK[spec.priority],
                "need": spec.total_gpus,
                "t": at,
            },
        ).one()
        job_id = int(row[0])
        self.add_transition(conn, job_id, JobState.queued, at, note)
        return job_id

    def job_by_submission(self, conn: Connection, user: str, submission_id: str) -> int | None:
        """The id of ``user``'s job with this submission id, if any."""
        row = conn.execute(
            text(f"SELECT id FROM jobs WHERE {OWNED_BY} AND submission_id = :s"),
            {"u": user, "s": submission_id},
        ).first()
        return None if row is None else int(row[0])

    def add_transition(
        self, conn: Connection, job_id: int, state: JobState, at: float, reason: str | None
    ) -> None:
        """Record one state change."""
        conn.execute(
            text("INSERT INTO transitions (job_id, state, at, reason) VALUES (:j, :s, :t, :r)"),
            {"j": job_id, "s": state.value, "t": at, "r": reason},
        )

    def update_job(self, conn: Connection, job_id: int, **fields: Any) -> None:
        """Set columns of one job; dicts, lists and models are stored as JSON."""
        values = {k: _column(v) for k, v in fields.items()}
        values = {k: v.value if isinstance(v, JobState) else v for k, v in values.items()}
        assignments = ", ".join(f"{k} = :{k}" for k in values)
        conn.execute(
            text(f"UPDATE jobs SET {assignments} WHERE id = :_id"), {**values, "_id": job_id}
        )

    def delete_job(self, job_id: int) -> None:
        """Remove a job and its transitions."""
        with self.tx() as conn:
            conn.execute(text("DELETE FROM transitions WHERE job_id = :j"), {"j": job_id})
            conn.execute(text("DELETE FROM jobs WHERE id = :j"), {"j": job_id})

    def get(self, job_id: int, conn: Connection | None = None) -> JobRecord | None:
        """One job with its transitions, or None."""
        if conn is None:
            with self.engine.connect() as c:
                return self.get(job_id, c)
        row = conn.execute(
            text(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = :j"), {"j": job_id}
        ).first()
        if row is None:
            return None
        return self._records(conn, [row])[0]

    def list_ids(
        self,
        user: str | None,
        state: JobState | None,
        limit: int,
        offset: int,
        hidden: Iterable[int] = (),
    ) -> tuple[list[int], int]:
        """Ids of a page of jobs, newest first, and how many match in all.

        The total is read from ``job_counts`` (a few rows, whatever the store holds) and the
        page from an index, so neither reads every job. ``hidden``: ids left out of both
        (the sessions their owners deleted, whose rows stay until their engines are gone).
        """
        where: list[str] = []
        params: dict[str, object] = {"lim": limit, "off": offset}
        counted: list[str] = []
        if user is not None:
            where.append(OWNED_BY)
            counted.append(f"user = :u AND uid = COALESCE({USER_ID}, -1)")
            params["u"] = user
        if state is not None:
            where.append("state = :s")
            counted.append("state = :s")
            params["s"] = state.value
        left_out = ",".join(str(int(i)) for i in sorted(set(hidden)))  # ints, never input
        clause = " AND ".join(where) or "1"
        with self.engine.connect() as conn:
            total = int(conn.execute(text(
                "SELECT COALESCE(SUM(n), 0) FROM job_counts"
                + (f" WHERE {' AND '.join(counted)}" if counted else "")
            ), params).scalar_one())  # fmt: skip
            page = f"SELECT id FROM jobs WHERE {clause}"
            if left_out:
                total -= int(conn.execute(text(
                    f"SELECT COUNT(*) FROM jobs WHERE {clause} AND id IN ({left_out})"
                ), params).scalar_one())  # fmt: skip
                page += f" AND id NOT IN ({left_out})"
            rows = conn.execute(
                text(f"{page} ORDER BY id DESC LIMIT :lim OFFSET :off"), params
            ).all()
        return [int(r[0]) for r in rows], total

    def records(self, ids: Sequence[int]) -> dict[int, JobRecord]:
        """The jobs with these ids that exist, by id."""
        if not ids:
            return {}
        marks = ",".join(str(int(i)) for i in ids)  # ints, never request text
        with self.engine.connect() as conn:
            rows = conn.execute(text(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id IN ({marks})")).all()
            return {r.id: r for r in self._records(conn, rows)}

    def _records(self, conn: Connection, rows: Sequence[Any]) -> list[JobRecord]:
        ids = [r[0] for r in rows]
        moves: dict[int, list[Transition]] = {i: [] for i in ids}
        if ids:
            marks = ",".join(str(int(i)) for i in ids)  # ints from the database, not input
            for t in conn.execute(
                text(
                    f"SELECT job_id, state, at, reason FROM transitions "
                    f"WHERE job_id IN ({marks}) ORDER BY seq"
                )
            ):
                moves[t[0]].append(Transition(state=JobState(t[1]), at=_at(t[2]), reason=t[3]))
        return [
            JobRecord(
                id=r[0],
                user=r[1],
                spec=JobSpec.model_validate_json(r[2]),
                state=JobState(r[3]),
                attempt=r[4],
                reason=r[5],
                exit_codes={int(k): v for k, v in json.loads(r[6]).items()},
                slots=json.loads(r[7]),
                created_at=_at(r[8]),
                started_at=_utc(r[9]),
                finished_at=_utc(r[10]),
                transitions=moves[r[0]],
                user_id=r[11],
                kind=r[12],
                container_id=r[13],
                elastic=ElasticInfo.model_validate_json(r[14]) if r[14] else None,
                park=ParkInfo.model_validate_json(r[15]) if r[15] else None,
            )
            for r in rows
        ]

    def jobs_in(self, states: Iterable[JobState]) -> list[JobRecord]:
        """Every job in one of ``states``, oldest first (used at start-up)."""
        names = [s.value for s in states]
        marks = ",".join(f":s{i}" for i in range(len(names)))
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(f"SELECT {JOB_COLUMNS} FROM jobs WHERE state IN ({marks}) ORDER BY id"),
                {f"s{i}": n for i, n in enumerate(names)},
            ).all()
            return self._records(conn, rows)

    def jobs_with_park(self) -> list[JobRecord]:
        """Every session with a snapshot on disk (parked, parking or resuming), oldest first."""
        with self.engine.connect() as conn:
            sql = text(f"SELECT {JOB_COLUMNS} FROM jobs WHERE park IS NOT NULL ORDER BY id")
            return self._records(conn, conn.execute(sql).all())

    def pending_rows(self) -> list[tuple[int, str, int, int, str, float | None]]:
        """``(id, user, need, priority, spec, retry_at)`` of queued and retrying jobs."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, user, need, priority, spec, retry_at FROM jobs "
                    "WHERE state IN ('queued', 'retrying') ORDER BY id"
                )
            ).all()
        return [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]

    def cancel_requested(self) -> set[int]:
        """Ids of active jobs whose cancellation was asked for."""
        with self.engine.connect() as conn:
            rows = conn.execute(text("SELECT id FROM jobs WHERE cancel_requested = 1"))
            return {int(r[0]) for r in rows}

    def add_session(
        self, conn: Connection, job_id: int, lease_s: float, idle_timeout_s: float | None
    ) -> None:
        """Record a session's lease and idle timeout (its job row is inserted in ``conn``)."""
        conn.execute(
            text("INSERT INTO sessions (job_id, lease_s, idle_timeout_s) VALUES (:j, :l, :i)"),
            {"j": job_id, "l": lease_s, "i": idle_timeout_s},
        )

    def drop_session(self, job_id: int) -> None:
        """Delete a session's terms: it is gone from lists (:meth:`dropped_sessions`)."""
        with self.tx() as conn:
            conn.execute(text("DELETE FROM sessions WHERE job_id = :j"), {"j": job_id})

    def dropped_sessions(self) -> set[int]:
        """Ids of sessions deleted by their owners whose rows are still here."""
        with self.engine.connect() as conn:
            return {int(r[0]) for r in conn.execute(text(f"SELECT id FROM jobs WHERE {DROPPED}"))}

    def session_terms(self) -> dict[int, tuple[float, float | None]]:
        """Job id -> (lease, idle timeout) of every session not finished (nor parked) yet."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT s.job_id, s.lease_s, s.idle_timeout_s FROM sessions s "
                    "JOIN jobs j ON j.id = s.job_id "
                    "WHERE j.state NOT IN ('succeeded', 'failed', 'cancelled', 'parked')"
                )
            ).all()
        return {int(r[0]): (float(r[1]), r[2]) for r in rows}

    def count_by_state(self) -> dict[str, int]:
        """Number of jobs in each state that has any (from ``job_counts``: a few rows)."""
        with self.engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT state, SUM(n) FROM job_counts GROUP BY state HAVING SUM(n) > 0"
            ))  # fmt: skip
            return {r[0]: int(r[1]) for r in rows}


def _column(value: Any) -> Any:
    """A value as its column stores it: JSON for dicts, lists and pydantic models."""
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    return json.dumps(value) if isinstance(value, dict | list) else value


def _user(row: Any) -> User:
    return User(
        id=row[0], name=row[1], is_admin=bool(row[2]), gpu_quota=row[3], os_uid=row[4],
        idle_timeout_s=row[5], limits=json.loads(row[6] or "{}"),
    )  # fmt: skip


def _now() -> float:
    return datetime.now(UTC).timestamp()
