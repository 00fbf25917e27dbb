"""The coordinator's roster and tokens in SQLite, where transactions make joins atomic.

Every change runs in one ``BEGIN IMMEDIATE`` transaction: checking the replay nonce, consuming
a token use, checking the name, allocating the address and inserting the member either all
happen or none do. Two joins racing with one single-use token are serialised by SQLite's write
lock, so exactly one wins. Member rows are never deleted (a removed member is marked revoked),
so a revoked member's address is never handed out again.
"""

from __future__ import annotations

import hmac
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mesh.addresses import allocate_address, parse_cidr
from mesh.errors import MeshError
from mesh.model import Roster, RosterEntry
from mesh.token import secret_hash

__all__ = ["AdmitRequest", "JoinRefused", "RosterStore"]

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


class JoinRefused(MeshError):
    """The coordinator refused a join or a request; the message says why and what to do."""

    def __init__(self, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AdmitRequest:
    """A decrypted, authenticated join request, ready to be admitted."""

    token_id: bytes
    secret: bytes
    nonce: bytes
    nonce_expires_at: float
    name: str
    public_key: str
    endpoint: str | None


class RosterStore:
    """The coordinator's SQLite database; each call opens its own short connection."""

    def __init__(self, path: Path) -> None:
        if not path.exists():
            raise MeshError(f"coordinator database {path} is missing: this machine is not a coordinator")
        self.path = path

    @classmethod
    def create(
        cls, path: Path, mesh_id: str, cidr: str, coordinator: RosterEntry, now: float | None = None
    ) -> RosterStore:
        """Create a new database with the mesh settings and the coordinator as its first member."""
        if path.exists():
            raise MeshError(f"coordinator database {path} already exists: a mesh was created here before")
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        store = cls(path)
        now = time.time() if now is None else now
        with store._connect() as db:
            db.executescript(_SCHEMA)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("BEGIN IMMEDIATE")
            db.executemany(
                "INSERT INTO meta(key, value) VALUES (?, ?)",
                [("mesh_id", mesh_id), ("cidr", cidr), ("revision", "1"), ("created_at", str(now))],
            )
            db.execute(
                "INSERT INTO members(name, address, public_key, endpoint, coordinator, joined_at) VALUES (?, ?, ?, ?, 1, ?)",
                (coordinator.name, coordinator.address, coordinator.public_key, coordinator.endpoint, now),
            )
            db.execute("COMMIT")
        return store

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=15.0, isolation_level=None)
        try:
            db.execute("PRAGMA busy_timeout=15000")
            yield db
        finally:
            db.close()

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

    def roster(self) -> Roster:
        """Return the active members and the current revision, read in one transaction."""
        with self._connect() as db:
            db.execute("BEGIN")
            rows = db.execute(
                "SELECT name, address, public_key, endpoint, coordinator FROM members WHERE revoked_at IS NULL ORDER BY id"
            ).fetchall()
            roster = Roster(
                mesh_id=self._meta(db, "mesh_id"),
                cidr=self._meta(db, "cidr"),
                revision=int(self._meta(db, "revision")),
                members=tuple(RosterEntry(r[0], r[1], r[2], r[3], bool(r[4])) for r in rows),
            )
            db.execute("COMMIT")
        return roster

    def add_token(
        self, token_id: bytes, hashed_secret: bytes, expires_at: float, uses: int, now: float | None = None
    ) -> None:
        """Store a new token: its id, the hash of its secret (never the secret), expiry and uses."""
        if uses < 1:
            raise MeshError("--uses must be at least 1")
        now = time.time() if now is None else now
        with self._write() as db:
            db.execute(
                "INSERT INTO tokens(token_id, secret_hash, created_at, expires_at, uses_left) VALUES (?, ?, ?, ?, ?)",
                (token_id, hashed_secret, now, expires_at, uses),
            )

    def token_hash(self, token_id: bytes) -> bytes | None:
        """Return the stored secret hash of a token, used to derive the join exchange keys."""
        with self._connect() as db:
            row = db.execute("SELECT secret_hash FROM tokens WHERE token_id = ?", (token_id,)).fetchone()
        return bytes(row[0]) if row else None

    def admit(self, request: AdmitRequest, now: float | None = None) -> RosterEntry:
        """Admit a joiner atomically, or raise :class:`JoinRefused` and change nothing."""
        now = time.time() if now is None else now
        with self._write() as db:
            db.execute("DELETE FROM nonces WHERE expires_at < ?", (now,))
            if db.execute("SELECT 1 FROM nonces WHERE nonce = ?", (request.nonce,)).fetchone():
                raise JoinRefused(
                    "replayed join message (its nonce was already used): run `shardpool mesh join` again", 409
                )
            db.execute(
                "INSERT INTO nonces(nonce, expires_at) VALUES (?, ?)",
                (request.nonce, request.nonce_expires_at),
            )
            self._consume_token(db, request, now)
            self._check_unique(db, request)
            used = [row[0] for row in db.execute("SELECT address FROM members")]
            try:
                address = allocate_address(parse_cidr(self._meta(db, "cidr")), used)
            except MeshError as error:
                raise JoinRefused(str(error), 507) from None
            db.execute(
                "INSERT INTO members(name, address, public_key, endpoint, joined_at) VALUES (?, ?, ?, ?, ?)",
                (request.name, address, request.public_key, request.endpoint, now),
            )
            self._bump(db)
        return RosterEntry(request.name, address, request.public_key, request.endpoint)

    @staticmethod
    def _consume_token(db: sqlite3.Connection, request: AdmitRequest, now: float) -> None:
        row = db.execute(
            "SELECT secret_hash, expires_at, uses_left FROM tokens WHERE token_id = ?", (request.token_id,)
        ).fetchone()
        if row is None:
            raise JoinRefused(
                "unknown join token (this coordinator never issued it): ask for a new one with `shardpool mesh invite`"
            )
        if not hmac.compare_digest(bytes(row[0]), secret_hash(request.secret)):
            raise JoinRefused(
                "join token secret is wrong (forged or corrupted token): ask for a new one with `shardpool mesh invite`"
            )
        if now >= row[1]:
            raise JoinRefused(
                "join token has expired: ask the coordinator for a new one with `shardpool mesh invite`"
            )
        if row[2] <= 0:
            raise JoinRefused(
                "join token was already used: ask the coordinator for a new one with `shardpool mesh invite`",
                409,
            )
        db.execute("UPDATE tokens SET uses_left = uses_left - 1 WHERE token_id = ?", (request.token_id,))

    @staticmethod
    def _check_unique(db: sqlite3.Connection, request: AdmitRequest) -> None:
        row = db.execute(
            "SELECT address FROM members WHERE name = ? AND revoked_at IS NULL", (request.name,)
        ).fetchone()
        if row:
            raise JoinRefused(
                f"name {request.name!r} is already taken by {row[0]} in this mesh: choose another with --name",
                409,
            )
        row = db.execute(
            "SELECT name FROM members WHERE public_key = ? AND revoked_at IS NULL", (request.public_key,)
        ).fetchone()
        if row:
            raise JoinRefused(
                f"this public key already belongs to member {row[0]!r}: leave the mesh first", 409
            )

    def revoke(self, name: str, now: float | None = None) -> RosterEntry:
        """Revoke the active member ``name``; its address stays reserved forever."""
        now = time.time() if now is None else now
        with self._write() as db:
            row = db.execute(
                "SELECT id, name, address, public_key, endpoint, coordinator FROM members WHERE name = ? AND revoked_at IS NULL",
                (name,),
            ).fetchone()
            if row is None:
                raise MeshError(
                    f"no active member is called {name!r}: see `shardpool mesh status` for the names"
                )
            if row[5]:
                raise MeshError(
                    f"{name!r} is the coordinator itself: to dismantle the mesh run `shardpool mesh leave` here"
                )
            db.execute("UPDATE members SET revoked_at = ? WHERE id = ?", (now, row[0]))
            self._bump(db)
        return RosterEntry(row[1], row[2], row[3], row[4])

    def lookup_key(self, public_key: str) -> tuple[RosterEntry, bool] | None:
        """Find the newest member row with this key; the flag says whether it was revoked."""
        with self._connect() as db:
            row = db.execute(
                "SELECT name, address, public_key, endpoint, coordinator, revoked_at FROM members "
                "WHERE public_key = ? ORDER BY revoked_at IS NULL DESC, id DESC LIMIT 1",
                (public_key,),
            ).fetchone()
        if row is None:
            return None
        return RosterEntry(row[0], row[1], row[2], row[3], bool(row[4])), row[5] is not None

    def counts(self) -> dict[str, int]:
        """Count members, revoked members and tokens (for tests and diagnostics)."""
        with self._connect() as db:
            return {
                "active": db.execute("SELECT COUNT(*) FROM members WHERE revoked_at IS NULL").fetchone()[0],
                "revoked": db.execute("SELECT COUNT(*) FROM members WHERE revoked_at IS NOT NULL").fetchone()[
                    0
                ],
                "tokens_usable": db.execute("SELECT COALESCE(SUM(uses_left), 0) FROM tokens").fetchone()[0],
            }
