"""Invites (join tokens) in the coordinator's database: issuing, listing and revoking them.

An invite is a row of ``tokens``; its secret is stored only as a hash. An invite may be made for
one member name (then only a joiner with that name is admitted) and can be revoked by id; every
member row records the invite it joined with. Using one up happens at admission
(:meth:`mesh.control.roster.RosterStore.admit`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh.control.model import check_name
from mesh.control.roster_db import CoordinatorDatabase, clock, finite
from mesh.errors import MeshError

__all__ = ["Invite", "InviteBook"]

_INVITE_HINT = "see `shardpool mesh invite --list`"


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


class InviteBook(CoordinatorDatabase):
    """The invites of a coordinator database."""

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
        expires_at = finite(expires_at, "token expiry")
        now = clock(now)
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
        now = clock(now)
        with self._write() as db:
            row = db.execute("SELECT revoked_at FROM tokens WHERE token_id = ?", (token_id,)).fetchone()
            if row is None:
                raise MeshError(f"no invite has id {token_id.hex()}: {_INVITE_HINT} for the ids")
            if row[0] is None:
                db.execute("UPDATE tokens SET revoked_at = ? WHERE token_id = ?", (now, token_id))
        invite = next(i for i in self.invites() if i.token_id == token_id.hex())
        return invite, row[0] is None
