"""The mesh members as the agent sees them, and matching an address to one of them.

The agent checks every address in a job, every probe target and the source of every mesh request
against the current members; :func:`same_ip` is the one comparison all of them use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardpool.contract.start import canonical_ip

__all__ = ["MeshPeer", "roster_peers", "same_ip"]


@dataclass(frozen=True)
class MeshPeer:
    """A current mesh member as the agent sees it: who, where, its key, and whether it is up."""

    name: str
    address: str
    public_key: str
    online: bool = True


def same_ip(left: str | None, right: str) -> bool:
    """Whether two addresses name the same host (scope ids dropped, IPv4-mapped IPv6 unmapped)."""

    return left is not None and canonical_ip(left) == canonical_ip(right)


def roster_peers(state_dir: Path) -> Callable[[], list[MeshPeer]]:
    """A function listing the current members from the mesh state in ``state_dir`` (re-read each call)."""

    def peers() -> list[MeshPeer]:
        from mesh.node.api import members

        return [
            MeshPeer(m.name, m.address, m.public_key, bool(m.online)) for m in members(state_dir, probe=False)
        ]

    return peers
