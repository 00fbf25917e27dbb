"""Who a public key belongs to: the directories a request verifier asks before it checks a MAC.

The coordinator asks its SQLite roster (which remembers removed members, so their refusal can be
signed); a member asks its cached roster file (current members only); tests use a fixed list.
A directory that cannot tell raises :class:`MeshError`, and the verifier then refuses (fails closed).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mesh.control.model import Roster
from mesh.control.roster import RosterStore
from mesh.errors import MeshError
from mesh.state import read_json

__all__ = ["CachedRosterDirectory", "Directory", "FixedDirectory", "Member", "RosterStoreDirectory"]


@dataclass(frozen=True)
class Member:
    """What a directory knows about one key: who it is, its mesh address, and whether it is current."""

    name: str
    address: str
    public_key: str
    current: bool


class Directory(Protocol):
    """Answers whether a public key belongs to a member; raises :class:`MeshError` when it cannot tell."""

    def lookup(self, public_key: str) -> Member | None:
        """Return the member with this key (current or removed), or ``None`` for a stranger."""
        ...


class FixedDirectory:
    """A directory over a fixed list of members, for tests and tools."""

    def __init__(self, members: Iterable[Member]) -> None:
        self._members = {member.public_key: member for member in members}

    def lookup(self, public_key: str) -> Member | None:
        """Return the listed member with this key, if any."""
        return self._members.get(public_key)


class RosterStoreDirectory:
    """The coordinator's directory: its SQLite roster, which also remembers removed members."""

    def __init__(self, store: RosterStore) -> None:
        self.store = store

    def lookup(self, public_key: str) -> Member | None:
        """Return the newest member row with this key; fail closed if the database cannot be read."""
        try:
            found = self.store.lookup_key(public_key)
        except sqlite3.Error as error:
            raise MeshError(f"cannot read the coordinator database {self.store.path}: {error}") from None
        if found is None:
            return None
        entry, revoked = found
        return Member(entry.name, entry.address, entry.public_key, current=not revoked)


class CachedRosterDirectory:
    """A member's directory: its cached roster file, re-read whenever the file changes.

    A missing, corrupt or foreign roster refuses every key (fails closed).
    """

    def __init__(self, roster_path: Path, mesh_id: str) -> None:
        self.roster_path = roster_path
        self.mesh_id = mesh_id
        self._stamp: tuple[int, int, int] | None = None
        self._roster: Roster | None = None
        self._lock = threading.Lock()

    def _current_roster(self) -> Roster:
        try:
            info = os.stat(self.roster_path)
        except OSError as error:
            raise MeshError(
                f"cannot read the roster {self.roster_path} ({error.strerror}): refusing every request until "
                "the sync daemon writes it (see `shardpool mesh status`)"
            ) from None
        stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
        # A file changed within the filesystem's timestamp granularity may keep its stamp: re-read it.
        recent = time.time() - info.st_mtime < 2.0
        with self._lock:
            if stamp != self._stamp or self._roster is None or recent:
                roster = Roster.from_json(read_json(self.roster_path))
                if roster.mesh_id != self.mesh_id:
                    raise MeshError(
                        f"roster {self.roster_path} is for mesh {roster.mesh_id}, not {self.mesh_id}: "
                        "refusing every request"
                    )
                self._roster, self._stamp = roster, stamp
            return self._roster

    def lookup(self, public_key: str) -> Member | None:
        """Return the roster member with this key; the roster only lists current members."""
        entry = self._current_roster().by_key(public_key)
        if entry is None:
            return None
        return Member(entry.name, entry.address, entry.public_key, current=True)
