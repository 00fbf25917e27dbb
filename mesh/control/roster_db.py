"""The coordinator's SQLite database file: its schema, migrations, connections and transactions.

Every change runs in one ``BEGIN IMMEDIATE`` transaction (:meth:`CoordinatorDatabase._write`), so
concurrent writers are serialised by SQLite's write lock. The schema version lives in
``PRAGMA user_version``; an older database is migrated when it is opened. What the tables hold is
:mod:`mesh.control.invites` (tokens) and :mod:`mesh.control.roster` (members, admission).
"""

from __future__ import annotations

import math
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from mesh.errors import MeshError

__all__ = ["SCHEMA_VERSION", "CoordinatorDatabase", "clock", "finite", "new_database", "open_database"]

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE members (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    address TEXT NOT NULL UNIQUE,
    public_key TEXT NOT NULL,
    endpoint TEXT,
    coordinator INTEGER NOT NULL DEFAULT 0,
    joined_at REAL NOT NULL,
    revoked_at REAL
);
CREATE UNIQUE INDEX active_name ON members(name) WHERE revoked_at IS NULL;
CREATE UNIQUE INDEX active_key ON members(public_key) WHERE revoked_at IS NULL;
CREATE TABLE tokens (
    token_id BLOB PRIMARY KEY,
    secret_hash BLOB NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    uses_left INTEGER NOT NULL
);
CREATE TABLE nonces (nonce BLOB PRIMARY KEY, expires_at REAL NOT NULL);
"""

# Each step moves the schema one version up; a database at version N gets steps N.. applied.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        # 1: invites can be made for a member name and revoked; members remember their invite.
        "ALTER TABLE tokens ADD COLUMN member_name TEXT",
        "ALTER TABLE tokens ADD COLUMN revoked_at REAL",
        "ALTER TABLE members ADD COLUMN token_id BLOB",
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)


def finite(value: float, what: str) -> float:
    """Refuse NaN and infinite times: every comparison with NaN is false, so it would never expire."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MeshError(f"{what} must be a finite number of seconds, not {value!r}")
    return float(value)


def clock(now: float | None) -> float:
    """The current time, or a given time that must be finite."""
    return time.time() if now is None else finite(now, "time")


@contextmanager
def open_database(path: Path) -> Iterator[sqlite3.Connection]:
    """One short autocommit connection; transactions are begun explicitly."""
    db = sqlite3.connect(path, timeout=15.0, isolation_level=None)
    try:
        db.execute("PRAGMA busy_timeout=15000")
        yield db
    finally:
        db.close()


@contextmanager
def new_database(path: Path) -> Iterator[sqlite3.Connection]:
    """Create the database file (mode 0600) with its tables; yield a connection in its first write transaction."""
    if path.exists():
        raise MeshError(f"coordinator database {path} already exists: a mesh was created here before")
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    with open_database(path) as db:
        db.executescript(_SCHEMA)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("BEGIN IMMEDIATE")
        yield db
        db.execute("COMMIT")


class CoordinatorDatabase:
    """An existing coordinator database, brought up to :data:`SCHEMA_VERSION` when opened.

    Each call opens its own short connection.
    """

    def __init__(self, path: Path) -> None:
        if not path.exists():
            raise MeshError(f"coordinator database {path} is missing: this machine is not a coordinator")
        self.path = path
        self._migrate()

    def _migrate(self) -> None:
        """Bring an older database up to :data:`SCHEMA_VERSION`, in one transaction."""
        with self._connect() as db:
            if db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
                return
            db.execute("BEGIN IMMEDIATE")
            try:
                version = db.execute("PRAGMA user_version").fetchone()[0]
                if version > SCHEMA_VERSION:
                    raise MeshError(
                        f"coordinator database {self.path} has schema version {version}, this shardpool "
                        f"understands up to {SCHEMA_VERSION}: upgrade shardpool"
                    )
                for step in _MIGRATIONS[version:]:
                    for statement in step:
                        db.execute(statement)
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _connect(self) -> AbstractContextManager[sqlite3.Connection]:
        return open_database(self.path)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._connect() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _meta(self, db: sqlite3.Connection, key: str) -> str:
        row = db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise MeshError(f"coordinator database {self.path} has no {key}: it is damaged")
        return str(row[0])

    @staticmethod
    def _bump(db: sqlite3.Connection) -> None:
        db.execute("UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'revision'")
