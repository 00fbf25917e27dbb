"""The WireGuard backend interface, its data types, and automatic choice of a backend.

Two backends implement :class:`WireGuardBackend`: the kernel module through pyroute2's netlink
(:mod:`mesh.wireguard.kernel`) and ``wireguard-go`` through its UAPI socket
(:mod:`mesh.wireguard.userspace`). Addresses, link state and routes go through :mod:`mesh.wireguard.links`
for both.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mesh.errors import MeshError

__all__ = [
    "BACKENDS",
    "DeviceStatus",
    "PeerConfig",
    "PeerStatus",
    "WireGuardBackend",
    "choose_backend",
    "make_backend",
]

BACKENDS = ("kernel", "userspace")


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


def kernel_available() -> bool:
    """Probe whether the kernel can make WireGuard links (module loaded or loadable)."""
    from mesh.wireguard.kernel import kernel_wireguard_available

    return kernel_wireguard_available()


def choose_backend(requested: str | None) -> str:
    """Pick ``kernel`` when the kernel has WireGuard, else ``userspace``; honour a forced choice."""
    if requested is not None:
        if requested not in BACKENDS:
            raise MeshError(f"--backend {requested!r} is unknown: use kernel or userspace")
        return requested
    if kernel_available():
        return "kernel"
    if shutil.which("wireguard-go"):
        return "userspace"
    raise MeshError(
        "no WireGuard found: this kernel has no wireguard module and wireguard-go is not installed "
        "(apt-get install wireguard-go wireguard-tools)"
    )


def make_backend(name: str, run_dir: Path, log_dir: Path) -> WireGuardBackend:
    """Build the backend called ``name``; the userspace one keeps wireguard-go's pid in ``run_dir``."""
    if name == "kernel":
        from mesh.wireguard.kernel import KernelBackend

        return KernelBackend()
    if name == "userspace":
        from mesh.wireguard.userspace import UserspaceBackend

        return UserspaceBackend(run_dir, log_dir)
    raise MeshError(f"backend {name!r} is unknown: use kernel or userspace")
