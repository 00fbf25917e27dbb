"""This machine's mesh settings, saved as ``mesh.json`` in the state directory."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from mesh.errors import MeshError
from mesh.files import write_json
from mesh.state import StatePaths, read_json

__all__ = [
    "DEFAULT_INTERFACE",
    "DEFAULT_KEEPALIVE",
    "DEFAULT_MTU",
    "DEFAULT_SYNC_INTERVAL",
    "MeshConfig",
    "load_config",
    "save_config",
]

DEFAULT_INTERFACE = "shardpool0"
DEFAULT_MTU = 1420
DEFAULT_KEEPALIVE = 25
DEFAULT_SYNC_INTERVAL = 2.0


@dataclass(frozen=True)
class MeshConfig:
    """Everything a machine needs to bring its interface and sync daemon back up after a restart."""

    role: str  # "coordinator" or "member"
    mesh_id: str
    name: str
    interface: str
    backend: str
    cidr: str
    address: str
    public_key: str
    endpoint: str | None
    listen_port: int
    mtu: int
    keepalive: int
    coordinator_key: str
    coordinator_endpoint: str
    coordinator_address: str
    api_port: int
    sync_interval: float = DEFAULT_SYNC_INTERVAL
    down: bool = False

    @property
    def is_coordinator(self) -> bool:
        """Whether this machine runs the coordinator."""
        return self.role == "coordinator"

    @property
    def prefixlen(self) -> int:
        """Prefix length of the mesh CIDR."""
        return int(self.cidr.split("/")[1])

    def with_changes(self, **changes: Any) -> MeshConfig:
        """Return a copy with some fields changed."""
        return replace(self, **changes)


def load_config(paths: StatePaths) -> MeshConfig:
    """Load this machine's settings, or explain that it is not in a mesh."""
    if not paths.config.exists():
        raise MeshError(
            f"no mesh state in {paths.root}: run `shardpool mesh init` or `shardpool mesh join`, "
            "or point --state-dir / SHARDPOOL_HOME at the right directory"
        )
    data = read_json(paths.config)
    known = {f.name for f in fields(MeshConfig)}
    try:
        return MeshConfig(**{k: v for k, v in data.items() if k in known})
    except TypeError as error:
        raise MeshError(
            f"state file {paths.config} is incomplete ({error}): run `shardpool mesh leave` and join again"
        ) from None


def save_config(paths: StatePaths, config: MeshConfig) -> None:
    """Save settings atomically."""
    write_json(paths.config, asdict(config), mode=0o600)
