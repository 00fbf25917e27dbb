"""The coordinator's roster in SQLite: admitting, revoking and removing members, atomically.

Every change runs in one ``BEGIN IMMEDIATE`` transaction: checking the replay nonce, consuming
a token use, checking the name, allocating the address and inserting the member either all
happen or none do. Two joins racing with one single-use token are serialised by SQLite's write
lock, so exactly one wins. Member rows are never deleted (a removed member is marked revoked),
so a revoked member's address is never handed out again.

Every member row records the invite it joined with, so removing a member also revokes the
invites tied to it. The database file itself (schema, migrations, transactions) is
:mod:`mesh.control.roster_db`; issuing and listing invites is :mod:`mesh.control.invites`.
"""

from __future__ import annotations

import hmac
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from mesh.addresses import allocate_address, parse_cidr
from mesh.control.invites import InviteBook
from mesh.control.model import Roster, RosterEntry, check_name
from mesh.control.roster_db import clock, finite, new_database
from mesh.control.token import secret_hash
from mesh.errors import MeshError

__all__ = ["AdmitRequest", "JoinRefused", "Removal", "RosterStore"]


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
class Removal:
    """What ``remove`` did: the member it revoked (if one was active) and the invites it revoked."""

    member: RosterEntry | None
    revoked_invites: tuple[str, ...]


class RosterStore(InviteBook):
    """The coordinator's database: its members and (from :class:`InviteBook`) its invites."""

    @classmethod
    def create(
        cls, path: Path, mesh_id: str, cidr: str, coordinator: RosterEntry, now: float | None = None
    ) -> RosterStore:
        """Create a new database with the mesh settings and the coordinator as its first member."""
        now = time.time() if now is None else now
        with new_database(path) as db:
            db.executemany(
                "INSERT INTO meta(key, value) VALUES (?, ?)",
                [("mesh_id", mesh_id), ("cidr", cidr), ("revision", "1"), ("created_at", str(now))],
            )
            db.execute(
                "INSERT INTO members(name, address, public_key, endpoint, coordinator, joined_at) VALUES (?, ?, ?, ?, 1, ?)",
                (coordinator.name, coordinator.address, coordinator.public_key, coordinator.endpoint, now),
            )
        return cls(path)

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

    def admit(self, request: AdmitRequest, now: float | None = None) -> RosterEntry:
        """Admit a joiner atomically, or raise :class:`JoinRefused` and change nothing."""
        now = clock(now)
        finite(request.nonce_expires_at, "join nonce expiry")
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
        now = clock(now)
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
        now = clock(now)
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
