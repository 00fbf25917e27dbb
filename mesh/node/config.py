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
    "RELAY_PORT_COUNT",
    "MeshConfig",
    "default_relay_ports",
    "load_config",
    "parse_relay_ports",
    "save_config",
]

DEFAULT_INTERFACE = "shardpool0"
DEFAULT_MTU = 1420
DEFAULT_KEEPALIVE = 25
DEFAULT_SYNC_INTERVAL = 2.0
RELAY_PORT_COUNT = 256
"""UDP ports a relay uses by default (two per relayed pair), just above the WireGuard listen port."""


def default_relay_ports(listen_port: int) -> tuple[int, int]:
    """The relay's default port range, first and last: ``listen_port+1 .. listen_port+256``
    (just below the listen port where that would pass 65535)."""
    if listen_port + RELAY_PORT_COUNT <= 65535:
        return listen_port + 1, listen_port + RELAY_PORT_COUNT
    return listen_port - RELAY_PORT_COUNT, listen_port - 1


def parse_relay_ports(text: str, listen_port: int) -> tuple[int, int]:
    """Parse ``--relay-ports A-B`` (at least two ports, within 1-65535, not the WireGuard port)."""
    first, dash, last = text.partition("-")
    if not (dash and first.strip().isdigit() and last.strip().isdigit()):
        raise MeshError(f"--relay-ports {text!r}: expected FIRST-LAST, e.g. 51821-52076")
    low, high = int(first), int(last)
    if not 1 <= low < high <= 65535:
        raise MeshError(f"--relay-ports {text!r}: need at least two ports, within 1-65535, first < last")
    if low <= listen_port <= high:
        raise MeshError(f"--relay-ports {text!r} includes the WireGuard listen port {listen_port}")
    return low, high


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
    relay: bool = False
    """Whether this machine relays for member pairs (coordinator: unless ``--no-relay``; member:
    with ``--relay``). Settings saved before relays existed load with the coordinator relaying."""
    relay_ports: tuple[int, int] = (0, 0)
    """First and last UDP port the relay may open; (0, 0) means :func:`default_relay_ports`."""

    def __post_init__(self) -> None:
        ports = tuple(self.relay_ports)  # JSON gives a list back
        if ports == (0, 0):
            ports = default_relay_ports(self.listen_port)
        object.__setattr__(self, "relay_ports", ports)

    @property
    def is_coordinator(self) -> bool:
        """Whether this machine runs the coordinator."""
        return self.role == "coordinator"

    @property
    def prefixlen(self) -> int:
        """Prefix length of the mesh CIDR."""
        return int(self.cidr.split("/")[1])

    @property
    def relay_port_range(self) -> range:
        """The relay's ports as a range, as :class:`mesh.relay.service.RelayService` takes them."""
        return range(self.relay_ports[0], self.relay_ports[1] + 1)

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
    values = {k: v for k, v in data.items() if k in known}
    values.setdefault("relay", values.get("role") == "coordinator")
    try:
        return MeshConfig(**values)
    except TypeError as error:
        raise MeshError(
            f"state file {paths.config} is incomplete ({error}): run `shardpool mesh leave` and join again"
        ) from None


def save_config(paths: StatePaths, config: MeshConfig) -> None:
    """Save settings atomically."""
    write_json(paths.config, asdict(config), mode=0o600)
