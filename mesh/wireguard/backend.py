"""The WireGuard backend interface and its data types (peer changes, device and peer status).

Two backends implement :class:`WireGuardBackend`: the kernel module through pyroute2's netlink
(:mod:`mesh.wireguard.kernel`) and ``wireguard-go`` through its UAPI socket
(:mod:`mesh.wireguard.userspace`). Addresses, link state and routes go through :mod:`mesh.wireguard.links`
for both. Picking and building one is :mod:`mesh.wireguard.choice`, which sits above both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["DeviceStatus", "PeerConfig", "PeerStatus", "WireGuardBackend"]


@dataclass(frozen=True)
class PeerConfig:
    """A change to one peer: add or update it, or remove it when ``remove`` is set.

    ``endpoint`` must be a literal ``IP:PORT`` (see :func:`mesh.addresses.resolve_endpoint`);
    ``None`` leaves the device's current endpoint alone, so roaming endpoints survive updates.
    """

    public_key: str
    allowed_ips: tuple[str, ...] = ()
    endpoint: str | None = None
    persistent_keepalive: int | None = None
    remove: bool = False


@dataclass(frozen=True)
class PeerStatus:
    """One peer as the device reports it."""

    public_key: str
    endpoint: str | None
    allowed_ips: tuple[str, ...]
    last_handshake: float | None
    rx_bytes: int
    tx_bytes: int
    persistent_keepalive: int


@dataclass(frozen=True)
class DeviceStatus:
    """A WireGuard device as it reports itself."""

    public_key: str | None
    listen_port: int
    peers: tuple[PeerStatus, ...] = field(default_factory=tuple)

    def peer(self, public_key: str) -> PeerStatus | None:
        """Return the peer with this public key, if the device has it."""
        return next((p for p in self.peers if p.public_key == public_key), None)


class WireGuardBackend(Protocol):
    """What the mesh needs from a WireGuard implementation."""

    name: str

    def create(self, ifname: str) -> None:
        """Create the WireGuard interface (no address, still down)."""

    def exists(self, ifname: str) -> bool:
        """Tell whether the interface exists and answers."""

    def configure(self, ifname: str, private_key: str, listen_port: int) -> None:
        """Set the device's private key and UDP listen port."""

    def update_peers(self, ifname: str, peers: list[PeerConfig]) -> None:
        """Add, update or remove the given peers, leaving others untouched."""

    def show(self, ifname: str) -> DeviceStatus:
        """Read the device's keys, port and every peer's counters."""

    def destroy(self, ifname: str) -> None:
        """Remove the interface and stop anything that serves it."""
