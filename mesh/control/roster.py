"""The coordinator's roster and tokens in SQLite, where transactions make joins atomic.

Every change runs in one ``BEGIN IMMEDIATE`` transaction: checking the replay nonce, consuming
a token use, checking the name, allocating the address and inserting the member either all
happen or none do. Two joins racing with one single-use token are serialised by SQLite's write
lock, so exactly one wins. Member rows are never deleted (a removed member is marked revoked),
so a revoked member's address is never handed out again.

Invites (join tokens) are rows of ``tokens``: an invite may be made for one member name (then
only a joiner with that name is admitted), can be revoked by id, and every member row records
the invite it joined with, so removing a member also revokes the invites tied to it. The
schema version lives in ``PRAGMA user_version``; older databases are migrated when opened.
"""

from __future__ import annotations

import hmac
import math
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from mesh.addresses import allocate_address, parse_cidr
from mesh.control.model import Roster, RosterEntry, check_name
from mesh.control.token import secret_hash
from mesh.errors import MeshError

__all__ = ["SCHEMA_VERSION", "AdmitRequest", "Invite", "JoinRefused", "Removal", "RosterStore"]

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
_INVITE_HINT = "see `shardpool mesh invite --list`"


def _finite(value: float, what: str) -> float:
    """Refuse NaN and infinite times: every comparison with NaN is false, so it would never expire."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise MeshError(f"{what} must be a finite number of seconds, not {value!r}")
    return float(value)


def _clock(now: float | None) -> float:
    """The current time, or a given time that must be finite."""
    return time.time() if now is None else _finite(now, "time")


@contextmanager
def _open(path: Path) -> Iterator[sqlite3.Connection]:
    """One short autocommit connection; transactions are begun explicitly."""
    db = sqlite3.connect(path, timeout=15.0, isolation_level=None)
    try:
        db.execute("PRAGMA busy_timeout=15000")
        yield db
    finally:
        db.close()


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


@dataclass(frozen=True)
class Invite:
    """One join token as the coordinator stores it (never its secret)."""

    token_id: str  # 16 lowercase hex digits
    created_at: float
    expires_at: float
    uses_left: int
    member_name: str | None
    revoked_at: float | None
    joined: tuple[str, ...]  # names of the members admitted with it, oldest first

    def state(self, now: float) -> str:
        """``revoked``, ``used``, ``expired`` or ``active`` (only active invites admit anybody)."""
        if self.revoked_at is not None:
            return "revoked"
        if self.uses_left <= 0:
            return "used"
        if now >= self.expires_at:
            return "expired"
        return "active"

    def to_json(self, now: float) -> dict[str, object]:
        """Return the invite as a JSON-ready dictionary, with its state at ``now``."""
        return {
            "id": self.token_id,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "uses_left": self.uses_left,
            "state": self.state(now),
            "name": self.member_name,
            "revoked_at": self.revoked_at,
            "joined": list(self.joined),
        }


@dataclass(frozen=True)
class Removal:
    """What ``remove`` did: the member it revoked (if one was active) and the invites it revoked."""

    member: RosterEntry | None
    revoked_invites: tuple[str, ...]


class RosterStore:
    """The coordinator's SQLite database; each call opens its own short connection."""

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

    @classmethod
    def create(
        cls, path: Path, mesh_id: str, cidr: str, coordinator: RosterEntry, now: float | None = None
    ) -> RosterStore:
        """Create a new database with the mesh settings and the coordinator as its first member."""
        if path.exists():
            raise MeshError(f"coordinator database {path} already exists: a mesh was created here before")
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        now = time.time() if now is None else now
        with _open(path) as db:
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
        return cls(path)

    def _connect(self) -> AbstractContextManager[sqlite3.Connection]:
        return _open(self.path)

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
        self,
        token_id: bytes,
        hashed_secret: bytes,
        expires_at: float,
        uses: int,
        now: float | None = None,
        *,
        member_name: str | None = None,
    ) -> None:
        """Store a new token: its id, the hash of its secret (never the secret), expiry and uses.

        With ``member_name`` the invite admits only a joiner of that name, and ``remove`` of that
        name revokes it.
        """
        if uses < 1:
            raise MeshError("--uses must be at least 1")
        expires_at = _finite(expires_at, "token expiry")
        now = _clock(now)
        if member_name is not None:
            check_name(member_name)
        with self._write() as db:
            if member_name is not None:
                row = db.execute(
                    "SELECT address FROM members WHERE name = ? AND revoked_at IS NULL", (member_name,)
                ).fetchone()
                if row:
                    raise MeshError(
                        f"member {member_name!r} already exists at {row[0]}: remove it first with "
                        f"`shardpool mesh remove {member_name}`, or invite another name"
                    )
            db.execute(
                "INSERT INTO tokens(token_id, secret_hash, created_at, expires_at, uses_left, member_name) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (token_id, hashed_secret, now, expires_at, uses, member_name),
            )

    def token_hash(self, token_id: bytes) -> bytes | None:
        """Return the stored secret hash of a token, used to derive the join exchange keys.

        A revoked token still has its hash, so its holder gets the sealed-channel check and then
        a clear "revoked" refusal from :meth:`admit`.
        """
        with self._connect() as db:
            row = db.execute("SELECT secret_hash FROM tokens WHERE token_id = ?", (token_id,)).fetchone()
        return bytes(row[0]) if row else None

    def invites(self) -> list[Invite]:
        """Every invite ever issued, oldest first, with the names of the members it admitted."""
        with self._connect() as db:
            db.execute("BEGIN")
            rows = db.execute(
                "SELECT token_id, created_at, expires_at, uses_left, member_name, revoked_at FROM tokens "
                "ORDER BY created_at, token_id"
            ).fetchall()
            joined: dict[bytes, list[str]] = {}
            for token_id, name in db.execute(
                "SELECT token_id, name FROM members WHERE token_id IS NOT NULL ORDER BY id"
            ):
                joined.setdefault(bytes(token_id), []).append(name)
            db.execute("COMMIT")
        return [
            Invite(bytes(r[0]).hex(), r[1], r[2], r[3], r[4], r[5], tuple(joined.get(bytes(r[0]), ())))
            for r in rows
        ]

    def revoke_invite(self, token_id: bytes, now: float | None = None) -> tuple[Invite, bool]:
        """Revoke one invite so it admits nobody; return it and whether this call revoked it."""
        now = _clock(now)
        with self._write() as db:
            row = db.execute("SELECT revoked_at FROM tokens WHERE token_id = ?", (token_id,)).fetchone()
            if row is None:
                raise MeshError(f"no invite has id {token_id.hex()}: {_INVITE_HINT} for the ids")
            if row[0] is None:
                db.execute("UPDATE tokens SET revoked_at = ? WHERE token_id = ?", (now, token_id))
        invite = next(i for i in self.invites() if i.token_id == token_id.hex())
        return invite, row[0] is None

    def admit(self, request: AdmitRequest, now: float | None = None) -> RosterEntry:
        """Admit a joiner atomically, or raise :class:`JoinRefused` and change nothing."""
        now = _clock(now)
        _finite(request.nonce_expires_at, "join nonce expiry")
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
                "INSERT INTO members(name, address, public_key, endpoint, joined_at, token_id) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (request.name, address, request.public_key, request.endpoint, now, request.token_id),
            )
            self._bump(db)
        return RosterEntry(request.name, address, request.public_key, request.endpoint)

    @staticmethod
    def _consume_token(db: sqlite3.Connection, request: AdmitRequest, now: float) -> None:
        row = db.execute(
            "SELECT secret_hash, expires_at, uses_left, revoked_at, member_name FROM tokens WHERE token_id = ?",
            (request.token_id,),
        ).fetchone()
        if row is None:
            raise JoinRefused(
                "unknown join token (this coordinator never issued it): ask for a new one with `shardpool mesh invite`"
            )
        if not hmac.compare_digest(bytes(row[0]), secret_hash(request.secret)):
            raise JoinRefused(
                "join token secret is wrong (forged or corrupted token): ask for a new one with `shardpool mesh invite`"
            )
        if row[3] is not None:
            raise JoinRefused(
                "join token was revoked on the coordinator: ask for a new one with `shardpool mesh invite`"
            )
        if row[4] is not None and row[4] != request.name:
            raise JoinRefused(
                f"join token was made for member {row[4]!r}, not {request.name!r}: "
                f"run `shardpool mesh join` again with --name {row[4]}"
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
        """Revoke the active member ``name``; its address stays reserved forever.

        This is what a member's own ``leave`` does; the coordinator's ``remove`` is :meth:`remove`.
        """
        now = _clock(now)
        with self._write() as db:
            entry = self._revoke_member(db, name, now)
            if entry is None:
                raise MeshError(
                    f"no active member is called {name!r}: see `shardpool mesh status` for the names"
                )
        return entry

    def remove(self, name: str, now: float | None = None) -> Removal:
        """Revoke member ``name`` and, in the same transaction, the invites tied to that name.

        Revoked invites: every still-usable invite made for ``name`` (``mesh invite --name``), and
        the invite the member joined with if it has uses left, since the removed machine still
        holds that token's text. With no active member of that name, pending invites made for it
        are still revoked; with neither, nothing changes and the call fails.
        """
        check_name(name)
        now = _clock(now)
        with self._write() as db:
            joined_with = db.execute(
                "SELECT token_id FROM members WHERE name = ? AND revoked_at IS NULL", (name,)
            ).fetchone()
            entry = self._revoke_member(db, name, now)
            rows = db.execute(
                "SELECT token_id FROM tokens WHERE revoked_at IS NULL AND uses_left > 0 AND expires_at > ? "
                "AND (member_name = ? OR token_id = ?) ORDER BY created_at, token_id",
                (now, name, joined_with[0] if joined_with else None),
            ).fetchall()
            if entry is None and not rows:
                raise MeshError(
                    f"no active member and no pending invite is called {name!r}: see `shardpool mesh status` "
                    f"and `shardpool mesh invite --list`"
                )
            db.executemany("UPDATE tokens SET revoked_at = ? WHERE token_id = ?", [(now, r[0]) for r in rows])
        return Removal(entry, tuple(bytes(r[0]).hex() for r in rows))

    def _revoke_member(self, db: sqlite3.Connection, name: str, now: float) -> RosterEntry | None:
        row = db.execute(
            "SELECT id, name, address, public_key, endpoint, coordinator FROM members WHERE name = ? AND revoked_at IS NULL",
            (name,),
        ).fetchone()
        if row is None:
            return None
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
                "tokens_usable": db.execute(
                    "SELECT COALESCE(SUM(uses_left), 0) FROM tokens WHERE revoked_at IS NULL"
                ).fetchone()[0],
            }
