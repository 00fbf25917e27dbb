"""Turning a roster into WireGuard peer changes: what to add, update and remove.

The plan is a pure function of the device's current peers, the wanted roster and the roster
applied last time, so it is unit-tested without any interface. An endpoint is only pushed when
a peer is new or its roster endpoint changed, so WireGuard's roaming (a peer behind NAT seen at
a new address) is not undone on every sync.

With path instructions from the coordinator (:mod:`mesh.control.paths`), a peer's instruction
endpoint (its relay, or its direct/LAN endpoint) is pushed when it differs from the one pushed
last (``pushed``, which also holds a punched endpoint that WireGuard may since have roamed from),
and peers with a hole-punch try on the device (``busy``) are left alone until it is judged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from mesh.control.model import PathInstruction, Roster, RosterEntry
from mesh.errors import MeshError
from mesh.wireguard.backend import DeviceStatus, PeerConfig

__all__ = ["plan_peer_changes", "wanted_peers"]

Resolver = Callable[[str], str]


def wanted_peers(roster: Roster, own_key: str) -> dict[str, RosterEntry]:
    """Return every member except this machine, keyed by public key."""
    return {member.public_key: member for member in roster.members if member.public_key != own_key}


def _resolved(member: RosterEntry, resolve: Resolver) -> str | None:
    if member.endpoint is None:
        return None
    try:
        return resolve(member.endpoint)
    except MeshError:
        return None


def plan_peer_changes(
    device: DeviceStatus,
    roster: Roster,
    own_key: str,
    keepalive: int,
    applied: Roster | None,
    resolve: Resolver,
    paths: Mapping[str, PathInstruction] | None = None,
    pushed: Mapping[str, str | None] | None = None,
    busy: frozenset[str] = frozenset(),
) -> list[PeerConfig]:
    """List the peer changes that make ``device`` match ``roster`` (removals first).

    ``paths`` are the coordinator's instructions per peer, ``pushed`` the instruction endpoints
    already on the device, ``busy`` the peers in a hole-punch try (only removed, never changed).
    """
    paths, pushed = paths or {}, pushed or {}
    wanted = wanted_peers(roster, own_key)
    changes = [
        PeerConfig(public_key=peer.public_key, remove=True)
        for peer in device.peers
        if peer.public_key not in wanted
    ]
    for key, member in wanted.items():
        current = device.peer(key)
        allowed = (f"{member.address}/32",)
        before = applied.by_key(key) if applied is not None else None
        endpoint_changed = before is None or before.endpoint != member.endpoint
        instructed = paths[key].endpoint if key in paths else None
        if current is None:
            endpoint = instructed or _resolved(member, resolve)
            changes.append(PeerConfig(key, allowed, endpoint, keepalive))
        elif key in busy:
            continue
        elif instructed is not None and instructed != pushed.get(key):
            changes.append(PeerConfig(key, allowed, instructed, keepalive))
        elif endpoint_changed and member.endpoint is not None:
            changes.append(PeerConfig(key, allowed, _resolved(member, resolve), keepalive))
        elif current.allowed_ips != allowed or current.persistent_keepalive != keepalive:
            changes.append(PeerConfig(key, allowed, None, keepalive))
    return changes
