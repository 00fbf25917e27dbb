"""Tests of mesh/node/reconcile.py: which peer changes turn a device into the roster."""

from __future__ import annotations

from mesh.control.model import Roster, RosterEntry
from mesh.node.reconcile import plan_peer_changes
from mesh.wireguard.backend import DeviceStatus, PeerConfig, PeerStatus
from mesh.wireguard.keys import generate_private_key, public_key

SELF, A, B, C = (public_key(generate_private_key()) for _ in range(4))


def _roster(*entries: RosterEntry) -> Roster:
    return Roster("m", "198.51.100.0/28", 1, (RosterEntry("me", "198.51.100.1", SELF, None, True), *entries))


def _peer(key: str, address: str, endpoint: str | None = None, keepalive: int = 25) -> PeerStatus:
    return PeerStatus(key, endpoint, (f"{address}/32",), None, 0, 0, keepalive)


def _plan(device: DeviceStatus, roster: Roster, applied: Roster | None = None) -> list[PeerConfig]:
    return plan_peer_changes(device, roster, SELF, 25, applied, lambda endpoint: endpoint)


def test_new_members_are_added_with_endpoint_and_keepalive() -> None:
    roster = _roster(
        RosterEntry("a", "198.51.100.2", A, "192.0.2.2:51820"), RosterEntry("b", "198.51.100.3", B)
    )
    changes = _plan(DeviceStatus(SELF, 51820), roster)
    assert changes == [
        PeerConfig(A, ("198.51.100.2/32",), "192.0.2.2:51820", 25),
        PeerConfig(B, ("198.51.100.3/32",), None, 25),
    ]


def test_self_is_never_a_peer() -> None:
    assert _plan(DeviceStatus(SELF, 51820), _roster()) == []


def test_removed_members_are_removed_first() -> None:
    roster = _roster(RosterEntry("a", "198.51.100.2", A))
    device = DeviceStatus(SELF, 51820, (_peer(C, "198.51.100.4"), _peer(A, "198.51.100.2")))
    assert _plan(device, roster, roster) == [PeerConfig(C, remove=True)]


def test_a_roamed_endpoint_is_left_alone_until_the_roster_changes_it() -> None:
    roster = _roster(RosterEntry("a", "198.51.100.2", A, "192.0.2.2:51820"))
    device = DeviceStatus(SELF, 51820, (_peer(A, "198.51.100.2", "198.51.100.23:40000"),))
    assert _plan(device, roster, roster) == []
    moved = _roster(RosterEntry("a", "198.51.100.2", A, "192.0.2.9:51820"))
    assert _plan(device, moved, roster) == [PeerConfig(A, ("198.51.100.2/32",), "192.0.2.9:51820", 25)]


def test_drifted_allowed_ips_or_keepalive_are_repaired() -> None:
    roster = _roster(RosterEntry("a", "198.51.100.2", A))
    device = DeviceStatus(SELF, 51820, (_peer(A, "198.51.100.9", keepalive=0),))
    assert _plan(device, roster, roster) == [PeerConfig(A, ("198.51.100.2/32",), None, 25)]


def test_unresolvable_endpoint_is_skipped_not_fatal() -> None:
    from mesh.errors import MeshError

    def fail(endpoint: str) -> str:
        raise MeshError("no DNS")

    roster = _roster(RosterEntry("a", "198.51.100.2", A, "nowhere.invalid:51820"))
    changes = plan_peer_changes(DeviceStatus(SELF, 51820), roster, SELF, 25, None, fail)
    assert changes == [PeerConfig(A, ("198.51.100.2/32",), None, 25)]


# ------------------------------------------------------------- path instructions from the coordinator


def _instructed(endpoint: str | None, path: str = "relay"):  # noqa: ANN202
    from mesh.control.model import PathInstruction

    return PathInstruction(path, endpoint, None)


def test_a_new_peer_starts_at_its_instruction_endpoint() -> None:
    roster = _roster(RosterEntry("a", "198.51.100.2", A))
    changes = plan_peer_changes(
        DeviceStatus(SELF, 51820), roster, SELF, 25, None, lambda e: e, {A: _instructed("203.0.113.1:51821")}
    )
    assert changes == [PeerConfig(A, ("198.51.100.2/32",), "203.0.113.1:51821", 25)]


def test_an_instruction_endpoint_is_pushed_once_and_a_roamed_one_is_then_left_alone() -> None:
    roster = _roster(RosterEntry("a", "198.51.100.2", A))
    device = DeviceStatus(SELF, 51820, (_peer(A, "198.51.100.2", "198.51.100.23:40000"),))
    paths = {A: _instructed("203.0.113.1:51821")}
    changes = plan_peer_changes(device, roster, SELF, 25, roster, lambda e: e, paths, {})
    assert changes == [PeerConfig(A, ("198.51.100.2/32",), "203.0.113.1:51821", 25)]
    pushed = {A: "203.0.113.1:51821"}
    assert plan_peer_changes(device, roster, SELF, 25, roster, lambda e: e, paths, pushed) == []


def test_a_punched_endpoint_is_not_pushed_over_the_roam() -> None:
    roster = _roster(RosterEntry("a", "198.51.100.2", A))
    device = DeviceStatus(SELF, 51820, (_peer(A, "198.51.100.2", "203.0.113.20:55555"),))
    paths = {A: _instructed("203.0.113.20:40002", "direct")}
    pushed = {A: "203.0.113.20:40002"}
    assert plan_peer_changes(device, roster, SELF, 25, roster, lambda e: e, paths, pushed) == []


def test_a_peer_in_a_try_is_left_alone_but_still_removed_when_gone() -> None:
    roster = _roster(RosterEntry("a", "198.51.100.2", A))
    device = DeviceStatus(SELF, 51820, (_peer(A, "198.51.100.2", "203.0.113.20:40002", keepalive=1),))
    paths = {A: _instructed("203.0.113.1:51821")}
    assert plan_peer_changes(device, roster, SELF, 25, roster, lambda e: e, paths, {}, frozenset({A})) == []
    assert plan_peer_changes(device, _roster(), SELF, 25, roster, lambda e: e, {}, {}, frozenset({A})) == [
        PeerConfig(A, remove=True)
    ]
