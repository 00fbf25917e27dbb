"""Tests of mesh/node/reconcile.py: which peer changes turn a device into the roster."""

from __future__ import annotations

from mesh.control.model import Roster, RosterEntry
from mesh.node.reconcile import plan_peer_changes
from mesh.wireguard.backend import DeviceStatus, PeerConfig, PeerStatus
from mesh.wireguard.keys import generate_private_key, public_key

SELF, A, B, C = (public_key(generate_private_key()) for _ in range(4))


def _roster(*entries: RosterEntry) -> Roster:
    return Roster("m", "10.77.0.0/24", 1, (RosterEntry("me", "10.77.0.1", SELF, None, True), *entries))


def _peer(key: str, address: str, endpoint: str | None = None, keepalive: int = 25) -> PeerStatus:
    return PeerStatus(key, endpoint, (f"{address}/32",), None, 0, 0, keepalive)


def _plan(device: DeviceStatus, roster: Roster, applied: Roster | None = None) -> list[PeerConfig]:
    return plan_peer_changes(device, roster, SELF, 25, applied, lambda endpoint: endpoint)


def test_new_members_are_added_with_endpoint_and_keepalive() -> None:
    roster = _roster(RosterEntry("a", "10.77.0.2", A, "192.0.2.2:51820"), RosterEntry("b", "10.77.0.3", B))
    changes = _plan(DeviceStatus(SELF, 51820), roster)
    assert changes == [
        PeerConfig(A, ("10.77.0.2/32",), "192.0.2.2:51820", 25),
        PeerConfig(B, ("10.77.0.3/32",), None, 25),
    ]


def test_self_is_never_a_peer() -> None:
    assert _plan(DeviceStatus(SELF, 51820), _roster()) == []


def test_removed_members_are_removed_first() -> None:
    roster = _roster(RosterEntry("a", "10.77.0.2", A))
    device = DeviceStatus(SELF, 51820, (_peer(C, "10.77.0.4"), _peer(A, "10.77.0.2")))
    assert _plan(device, roster, roster) == [PeerConfig(C, remove=True)]


def test_a_roamed_endpoint_is_left_alone_until_the_roster_changes_it() -> None:
    roster = _roster(RosterEntry("a", "10.77.0.2", A, "192.0.2.2:51820"))
    device = DeviceStatus(SELF, 51820, (_peer(A, "10.77.0.2", "198.51.100.7:40000"),))
    assert _plan(device, roster, roster) == []
    moved = _roster(RosterEntry("a", "10.77.0.2", A, "192.0.2.9:51820"))
    assert _plan(device, moved, roster) == [PeerConfig(A, ("10.77.0.2/32",), "192.0.2.9:51820", 25)]


def test_drifted_allowed_ips_or_keepalive_are_repaired() -> None:
    roster = _roster(RosterEntry("a", "10.77.0.2", A))
    device = DeviceStatus(SELF, 51820, (_peer(A, "10.77.0.9", keepalive=0),))
    assert _plan(device, roster, roster) == [PeerConfig(A, ("10.77.0.2/32",), None, 25)]


def test_unresolvable_endpoint_is_skipped_not_fatal() -> None:
    from mesh.errors import MeshError

    def fail(endpoint: str) -> str:
        raise MeshError("no DNS")

    roster = _roster(RosterEntry("a", "10.77.0.2", A, "nowhere.invalid:51820"))
    changes = plan_peer_changes(DeviceStatus(SELF, 51820), roster, SELF, 25, None, fail)
    assert changes == [PeerConfig(A, ("10.77.0.2/32",), None, 25)]
