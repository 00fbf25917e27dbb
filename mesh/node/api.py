"""The Python API for the training side: who is in the mesh, at which address, and who is online.

Example::

    from mesh.node.api import members
    for m in members():
        if m.online and not m.is_self:
            connect(m.address)

Reads only local state (the roster cache or the coordinator's database, and the WireGuard
device); it never talks to the coordinator, so it works while the coordinator is down.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from mesh.control.model import Roster
from mesh.control.roster import RosterStore
from mesh.errors import MeshError
from mesh.node.config import MeshConfig, load_config
from mesh.node.member import backend_for, load_cached_roster
from mesh.node.probe import probe_all
from mesh.state import StatePaths, resolve_state_dir
from mesh.wireguard.backend import DeviceStatus

__all__ = ["HANDSHAKE_FRESH_SECONDS", "Member", "current_roster", "device_status", "member", "members"]

HANDSHAKE_FRESH_SECONDS = 180.0


@dataclass(frozen=True)
class Member:
    """One machine of the mesh as seen from this machine."""

    name: str
    address: str
    public_key: str
    endpoint: str | None
    online: bool
    is_self: bool
    coordinator: bool
    last_handshake: float | None
    rx_bytes: int
    tx_bytes: int


def current_roster(paths: StatePaths, config: MeshConfig) -> Roster:
    """Return the authoritative roster on the coordinator, the cached one on members."""
    if config.is_coordinator and paths.database.exists():
        return RosterStore(paths.database).roster()
    roster = load_cached_roster(paths)
    if roster is None:
        raise MeshError(f"no cached roster in {paths.root}: run `shardpool mesh up` to sync it")
    return roster


def device_status(paths: StatePaths, config: MeshConfig) -> DeviceStatus | None:
    """Read the WireGuard device, or ``None`` when the interface is down."""
    backend = backend_for(paths, config)
    try:
        return backend.show(config.interface) if backend.exists(config.interface) else None
    except MeshError:
        return None


def members(
    state_dir: str | os.PathLike[str] | None = None, *, probe: bool = True, timeout: float = 1.0
) -> list[Member]:
    """List every active member, this machine included, in roster order.

    ``online`` is true for this machine when its interface is up; for a peer, when it answered
    an ICMP echo over the mesh within ``timeout`` seconds (``probe=True``), or when WireGuard
    completed a handshake with it in the last 180 s (``probe=False``, no packets sent).
    Raises :class:`mesh.errors.MeshError` when this machine is not in a mesh.
    """
    paths = StatePaths(resolve_state_dir(state_dir))
    config = load_config(paths)
    roster = current_roster(paths, config)
    device = device_status(paths, config)
    others = [m.address for m in roster.members if m.public_key != config.public_key]
    reachable = probe_all(others, timeout) if probe and device is not None else {}
    now = time.time()
    result = []
    for entry in roster.members:
        is_self = entry.public_key == config.public_key
        peer = device.peer(entry.public_key) if device is not None else None
        handshake = peer.last_handshake if peer else None
        if is_self:
            online = device is not None
        elif probe:
            online = reachable.get(entry.address, False)
        else:
            online = handshake is not None and now - handshake < HANDSHAKE_FRESH_SECONDS
        result.append(
            Member(
                name=entry.name,
                address=entry.address,
                public_key=entry.public_key,
                endpoint=(peer.endpoint if peer and peer.endpoint else entry.endpoint),
                online=online,
                is_self=is_self,
                coordinator=entry.coordinator,
                last_handshake=handshake,
                rx_bytes=peer.rx_bytes if peer else 0,
                tx_bytes=peer.tx_bytes if peer else 0,
            )
        )
    return result


def member(name: str, state_dir: str | os.PathLike[str] | None = None, *, probe: bool = True) -> Member:
    """Return the member called ``name``, or raise :class:`MeshError` naming the known members."""
    found = members(state_dir, probe=probe)
    for entry in found:
        if entry.name == name:
            return entry
    raise MeshError(f"no member called {name!r}; the mesh has: {', '.join(m.name for m in found)}")
