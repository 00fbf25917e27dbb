"""Where a machine keeps its mesh state (written through :mod:`mesh.files`, atomically).

The state directory is ``--state-dir``, else ``$SHARDPOOL_HOME``, else ``/var/lib/shardpool`` for
root and ``~/.local/share/shardpool`` for anyone else.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.constants import ROOT_STATE_DIR, STATE_DIR_ENV
from mesh.errors import MeshError

__all__ = ["StatePaths", "default_state_dir", "read_json", "resolve_state_dir"]


def default_state_dir() -> Path:
    """Return ``$SHARDPOOL_HOME`` if set, else the root or per-user default directory."""
    env = os.environ.get(STATE_DIR_ENV)
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return ROOT_STATE_DIR
    return Path.home() / ".local" / "share" / "shardpool"


def resolve_state_dir(explicit: str | os.PathLike[str] | None) -> Path:
    """Pick the state directory: an explicit ``--state-dir`` wins over the environment and defaults."""
    return Path(explicit) if explicit else default_state_dir()


def read_json(path: Path) -> Any:
    """Read a JSON state file, turning corruption into a one-line error that names the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise MeshError(
            f"state file {path} is corrupt ({error.msg}): restore it or run `shardpool mesh leave` and join again"
        ) from None


class _StateFile:
    """A path at a fixed place under the state root, read as an attribute of :class:`StatePaths`."""

    def __init__(self, relative: str) -> None:
        self.relative = relative

    def __get__(self, paths: StatePaths, owner: type[StatePaths] | None = None) -> Path:
        return paths.root / self.relative


@dataclass(frozen=True)
class StatePaths:
    """The files of one machine's mesh state, all under one root directory."""

    root: Path

    config = _StateFile("mesh.json")
    """This machine's mesh settings (JSON)."""
    private_key = _StateFile("private.key")
    """This machine's WireGuard private key (base64, mode 0600)."""
    roster = _StateFile("roster.json")
    """The cached roster, used while the coordinator is unreachable."""
    database = _StateFile("coordinator.db")
    """The coordinator's SQLite roster and token store (coordinator only)."""
    run = _StateFile("run")
    """Pid files and live status of background processes."""
    logs = _StateFile("logs")
    """Logs of background processes."""
    syncd_pid = _StateFile("run/syncd.pid")
    """Pid file of the background sync daemon (roster sync, and the coordinator service if any)."""
    syncd_status = _StateFile("run/syncd-status.json")
    """The sync daemon's last sync result, for ``mesh status``."""
    syncd_log = _StateFile("logs/syncd.log")
    """Log of the background sync daemon."""

    def ensure(self) -> None:
        """Create the state directory tree, private to its owner."""
        for directory in (self.root, self.run, self.logs):
            directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
