"""The schema of the job service's SQLite store (control plane), as a list of migrations.

Each step of :data:`MIGRATIONS` upgrades the schema by one version (``PRAGMA user_version``);
:meth:`hora_service.store.db.Store.migrate` runs the steps a store has not had yet, one
transaction each. Never edit a released step: add one.
"""

from __future__ import annotations


def _count(row: str, sign: str) -> str:
    """Trigger statements that count ``row`` (``NEW`` or ``OLD``) in or out of job_counts."""
    key = f"{row}.user, COALESCE({row}.user_id, -1), {row}.state"
    return (  # INSERT OR IGNORE then UPDATE: an upsert the oldest SQLite 3 in use still takes
        f"INSERT OR IGNORE INTO job_counts (user, uid, state, n) VALUES ({key}, 0); "
        f"UPDATE job_counts SET n = n {sign} 1 WHERE user = {row}.user "
        f"AND uid = COALESCE({row}.user_id, -1) AND state = {row}.state;"
    )


# Each step upgrades the schema by one version; never edit a released step, add one.
MIGRATIONS: list[list[str]] = [
    [
        """CREATE TABLE users (
            name TEXT PRIMARY KEY,
            token_hash TEXT NOT NULL UNIQUE,
            is_admin INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL)""",
        """CREATE TABLE jobs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            user TEXT NOT NULL,
            submission_id TEXT,
            spec TEXT NOT NULL,
            state TEXT NOT NULL,
            priority INTEGER NOT NULL,
            need INTEGER NOT NULL,
            attempt INTEGER NOT NULL DEFAULT 0,
            reason TEXT,
            exit_codes TEXT NOT NULL DEFAULT '{}',
            slots TEXT NOT NULL DEFAULT '[]',
            created_at REAL NOT NULL,
            started_at REAL,
            finished_at REAL,
            UNIQUE (user, submission_id))""",
        "CREATE INDEX jobs_by_user ON jobs (user, id)",
        "CREATE INDEX jobs_by_state ON jobs (state, id)",
        """CREATE TABLE transitions (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            job_id INTEGER NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
            state TEXT NOT NULL,
            at REAL NOT NULL,
            reason TEXT)""",
        "CREATE INDEX transitions_by_job ON transitions (job_id, seq)",
    ],
    [
        # v2: per-user GPU quota, and the time a retrying job may start again
        "ALTER TABLE users ADD COLUMN gpu_quota INTEGER",
        "ALTER TABLE jobs ADD COLUMN retry_at REAL",
        "ALTER TABLE jobs ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0",
    ],
    [
        # v3: users get a stable id that is never reused (jobs belong to it, not to a name
        # a later user may take) and the OS account their jobs run as in multi-user mode
        """CREATE TABLE users_v3 (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            name TEXT NOT NULL UNIQUE,
            token_hash TEXT NOT NULL UNIQUE,
            is_admin INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL,
            gpu_quota INTEGER,
            os_uid INTEGER UNIQUE)""",
        """INSERT INTO users_v3 (name, token_hash, is_admin, created_at, gpu_quota)
            SELECT name, token_hash, is_admin, created_at, gpu_quota FROM users
            ORDER BY created_at""",
        "DROP TABLE users",
        "ALTER TABLE users_v3 RENAME TO users",
        "ALTER TABLE jobs ADD COLUMN user_id INTEGER",
        "UPDATE jobs SET user_id = (SELECT id FROM users WHERE users.name = jobs.user)",
        "CREATE INDEX jobs_by_user_id ON jobs (user_id, id)",
    ],
    [
        # v4: sessions (interactive engines of a notebook) are jobs of kind 'session' with
        # their lease and idle timeout beside them
        "ALTER TABLE jobs ADD COLUMN kind TEXT NOT NULL DEFAULT 'job'",
        """CREATE TABLE sessions (
            job_id INTEGER PRIMARY KEY REFERENCES jobs (id) ON DELETE CASCADE,
            lease_s REAL NOT NULL,
            idle_timeout_s REAL)""",
    ],
    [
        # v5: the container of a docker job's current attempt
        "ALTER TABLE jobs ADD COLUMN container_id TEXT",
    ],
    [
        # v6: a per-user idle timeout of notebook sessions (NULL: the service's default)
        "ALTER TABLE users ADD COLUMN idle_timeout_s REAL",
    ],
    [
        # v7: a user's own job limits ({"memory": "8g", "pids": "4096", "cpus": "2"})
        "ALTER TABLE users ADD COLUMN limits TEXT NOT NULL DEFAULT '{}'",
    ],
    ["ALTER TABLE jobs ADD COLUMN elastic TEXT"],  # v8: an elastic job's size (ElasticInfo)
    ["ALTER TABLE jobs ADD COLUMN park TEXT"],  # v9: a session's snapshot (ParkInfo)
    [
        # v10: how many jobs each owner has in each state, kept by triggers in the writing
        # transaction, so that a list's total and the metrics' counts read a few rows instead
        # of counting every job (``uid`` is -1 for a job of no user, in tests); and an index
        # for a page of one user's jobs in one state
        """CREATE TABLE job_counts (
            user TEXT NOT NULL,
            uid INTEGER NOT NULL,
            state TEXT NOT NULL,
            n INTEGER NOT NULL,
            PRIMARY KEY (user, uid, state)) WITHOUT ROWID""",
        """INSERT INTO job_counts (user, uid, state, n)
            SELECT user, COALESCE(user_id, -1), state, COUNT(*) FROM jobs GROUP BY 1, 2, 3""",
        f"""CREATE TRIGGER jobs_counted_in AFTER INSERT ON jobs BEGIN {_count("NEW", "+")} END""",
        f"""CREATE TRIGGER jobs_counted_out AFTER DELETE ON jobs BEGIN {_count("OLD", "-")} END""",
        f"""CREATE TRIGGER jobs_counted_moved AFTER UPDATE OF user, user_id, state ON jobs
            WHEN OLD.user IS NOT NEW.user OR OLD.user_id IS NOT NEW.user_id
                OR OLD.state IS NOT NEW.state
            BEGIN {_count("OLD", "-")} {_count("NEW", "+")} END""",
        "CREATE INDEX jobs_by_user_state ON jobs (user, state, id)",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)
