"""What every mesh command shares: the state directory from ``--state-dir`` and the checks
that refuse to run (not root, a mesh already here, not the coordinator) in one clear line.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

from mesh.errors import MeshError
from mesh.node.config import MeshConfig
from mesh.state import StatePaths, resolve_state_dir

__all__ = [
    "checked_mtu",
    "default_name",
    "discard_state",
    "require_coordinator",
    "require_no_mesh",
    "require_root",
    "print_table",
    "state_paths",
]


def state_paths(args: argparse.Namespace) -> StatePaths:
    """The state directory a command works on: ``--state-dir``, else the environment or default."""
    return StatePaths(resolve_state_dir(args.state_dir))


def require_root(action: str) -> None:
    """Refuse ``action`` unless run as root, since it changes network interfaces."""
    if os.geteuid() != 0:
        raise MeshError(
            f"`shardpool mesh {action}` changes network interfaces and needs root: run it with sudo"
        )


def require_no_mesh(paths: StatePaths) -> None:
    """Refuse to create or join a mesh where the state directory already holds one."""
    if paths.config.exists() or paths.database.exists():
        raise MeshError(
            f"{paths.root} already holds a mesh: run `shardpool mesh leave` first, or use another --state-dir"
        )


def require_coordinator(config: MeshConfig, action: str) -> None:
    """Refuse ``action`` on a member: only the coordinator keeps the roster and the invites."""
    if not config.is_coordinator:
        raise MeshError(
            f"this machine is a member, not the coordinator: run `shardpool mesh {action}` on "
            f"{config.coordinator_endpoint}"
        )


def default_name() -> str:
    """This machine's member name when ``--name`` is not given: its host name, made a valid name."""
    cleaned = "".join(c if c.isalnum() else "-" for c in socket.gethostname().lower()).strip("-")
    return (cleaned or "machine")[:63]


def checked_mtu(value: int | None) -> int | None:
    """Return ``--mtu`` if it is absent or within 1280-9000, else refuse it."""
    if value is not None and not 1280 <= value <= 9000:
        raise MeshError(f"--mtu {value} is out of range: use 1280-9000 (1420 suits most links)")
    return value


def discard_state(paths: StatePaths) -> None:
    """Remove what a failed ``init``/``join`` created, keeping logs for diagnosis."""
    for path in (paths.config, paths.private_key, paths.roster, paths.syncd_status):
        path.unlink(missing_ok=True)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{paths.database}{suffix}").unlink(missing_ok=True)


def print_table(table: list[tuple[str, ...]]) -> None:
    """Print rows (the first is the header) as left-aligned columns two spaces apart."""
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    for line in table:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
