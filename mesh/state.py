"""Where a machine keeps its mesh state, and how every file there is written (atomically).

The state directory is ``--state-dir``, else ``$SHARDPOOL_HOME``, else ``/var/lib/shardpool`` for
root and ``~/.local/share/shardpool`` for anyone else.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.errors import MeshError

__all__ = ["StatePaths", "atomic_write", "default_state_dir", "read_json", "resolve_state_dir", "write_json"]


def default_state_dir() -> Path:
    """Return ``$SHARDPOOL_HOME`` if set, else the root or per-user default directory."""
    env = os.environ.get("SHARDPOOL_HOME")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/shardpool")
    return Path.home() / ".local" / "share" / "shardpool"


def resolve_state_dir(explicit: str | os.PathLike[str] | None) -> Path:
    """Pick the state directory: an explicit ``--state-dir`` wins over the environment and defaults."""
    return Path(explicit) if explicit else default_state_dir()


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so readers see either the old or the new file, never a partial one.

    The temporary file is created in the same directory with ``mode`` already set, synced, then
    renamed over the target; the directory is synced so the rename survives a crash.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_json(path: Path, obj: Any, mode: int = 0o644) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"), mode=mode)


def read_json(path: Path) -> Any:
    """Read a JSON state file, turning corruption into a one-line error that names the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise MeshError(
            f"state file {path} is corrupt ({error.msg}): restore it or run `shardpool mesh leave` and join again"
        ) from None


@dataclass(frozen=True)
class StatePaths:
    """The files of one machine's mesh state, all under one root directory."""

    root: Path

    @property
    def config(self) -> Path:
        """This machine's mesh settings (JSON)."""
        return self.root / "mesh.json"

    @property
    def private_key(self) -> Path:
        """This machine's WireGuard private key (base64, mode 0600)."""
        return self.root / "private.key"

    @property
    def roster(self) -> Path:
        """The cached roster, used while the coordinator is unreachable."""
        return self.root / "roster.json"

    @property
    def database(self) -> Path:
        """The coordinator's SQLite roster and token store (coordinator only)."""
        return self.root / "coordinator.db"

    @property
    def run(self) -> Path:
        """Pid files and live status of background processes."""
        return self.root / "run"

    @property
    def logs(self) -> Path:
        """Logs of background processes."""
        return self.root / "logs"

    @property
    def syncd_pid(self) -> Path:
        """Pid file of the background sync daemon (roster sync, and the coordinator service if any)."""
        return self.run / "syncd.pid"

    @property
    def syncd_status(self) -> Path:
        """The sync daemon's last sync result, for ``mesh status``."""
        return self.run / "syncd-status.json"

    @property
    def syncd_log(self) -> Path:
        """Log of the background sync daemon."""
        return self.logs / "syncd.log"

    def ensure(self) -> None:
        """Create the state directory tree, private to its owner."""
        for directory in (self.root, self.run, self.logs):
            directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
