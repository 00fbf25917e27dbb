"""Tests of mesh/daemon.py: one sync step against a real coordinator, an absent one, and after removal.

The WireGuard device is replaced by an in-memory fake here (pure bookkeeping); the real device
path is covered by tests/mesh/test_e2e.py.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from mesh.control.client import request_join
from mesh.control.paths import pair_id
from mesh.node.member import load_cached_roster, run_tries
from mesh.node.pathing import CoordinatorPaths
from mesh.wireguard.backend import DeviceStatus, PeerStatus
from mesh.wireguard.keys import generate_private_key, public_key
from tests.helpers.mesh_hosts import FakeDevice, InProcessCoordinator, member_daemon


@pytest.fixture
def coordinator(tmp_path):
    service = InProcessCoordinator(tmp_path / "coord")
    yield service
    service.close()


def _member(tmp_path, coordinator: InProcessCoordinator, monkeypatch, port: int | None = None):  # noqa: ANN202
    return member_daemon(tmp_path / "b", coordinator, monkeypatch, api_port=port)


def test_step_pulls_new_members_and_caches_the_roster(tmp_path, coordinator, monkeypatch) -> None:
    daemon, device = _member(tmp_path, coordinator, monkeypatch)
    assert daemon.step() is True
    assert set(device.peers) == {coordinator.public_key}
    newcomer = public_key(generate_private_key())
    request_join(coordinator.invite(), "c", newcomer, "192.0.2.3:51820")
    assert daemon.step() is True
    assert set(device.peers) == {coordinator.public_key, newcomer}
    assert device.peers[newcomer].endpoint == "192.0.2.3:51820"
    assert [m.name for m in load_cached_roster(daemon.paths).members] == ["coord", "b", "c"]
    assert daemon.status["last_error"] is None


def test_step_keeps_the_cached_roster_while_the_coordinator_is_down(
    tmp_path, coordinator, monkeypatch
) -> None:
    daemon, device = _member(tmp_path, coordinator, monkeypatch, port=9)
    assert daemon.step() is True
    assert set(device.peers) == {coordinator.public_key}
    assert "using the cached roster" in str(daemon.status["last_error"])


def test_removed_member_drops_every_peer_and_stops(tmp_path, coordinator, monkeypatch) -> None:
    daemon, device = _member(tmp_path, coordinator, monkeypatch)
    daemon.step()
    coordinator.store.revoke("b")
    assert daemon.step() is False
    assert device.peers == {}
    assert daemon.status["revoked"] is True


# ------------------------------------------------------------------ path planning across the wire


class CountingDevice(FakeDevice):
    """A fake device that keeps an endpoint a change leaves unset, and can say a peer's packets arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.heard: dict[str, tuple[int, float]] = {}

    def update_peers(self, ifname: str, peers: list) -> None:
        for peer in peers:
            before = self.peers.get(peer.public_key)
            if before is not None and not peer.remove and peer.endpoint is None:
                peer = replace(peer, endpoint=before.endpoint)
            super().update_peers(ifname, [peer])

    def show(self, ifname: str):  # noqa: ANN201
        status = super().show(ifname)
        peers = tuple(
            replace(p, rx_bytes=self.heard[p.public_key][0], last_handshake=self.heard[p.public_key][1])
            if p.public_key in self.heard
            else p
            for p in status.peers
        )
        return replace(status, peers=peers)


class FakeRelay:
    host = "203.0.113.1"

    def __init__(self) -> None:
        self.wanted: list = []

    def grant(self, wanted: list) -> dict[str, tuple[int, int]]:
        self.wanted = wanted
        return {want.pair: (51821 + 2 * i, 51822 + 2 * i) for i, want in enumerate(wanted)}


def test_two_members_are_relayed_then_punch_direct_through_report_and_roster(
    tmp_path, coordinator, monkeypatch
) -> None:
    """Members b and c without endpoints, a coordinator that plans their path: relay, try, direct."""
    b, device_b = member_daemon(tmp_path / "b", coordinator, monkeypatch, name="b", device=CountingDevice())
    c, device_c = member_daemon(tmp_path / "c", coordinator, monkeypatch, name="c", device=CountingDevice())
    key_b, key_c = b.config.public_key, c.config.public_key
    observed = {key_b: "198.51.100.18:40000", key_c: "198.51.100.19:40000"}
    clock = [time.time()]
    relay = FakeRelay()
    planning = CoordinatorPaths(coordinator.service.board, 2.0, relay, clock=lambda: clock[0])
    coordinator_device = DeviceStatus(
        None, 51820, tuple(PeerStatus(k, e, (), None, 0, 0, 25) for k, e in observed.items())
    )

    def sync_all() -> None:
        assert b.step() and c.step()
        planning.step(coordinator.store.roster(), coordinator_device)
        assert b.step() and c.step()

    sync_all()
    assert [w.pair for w in relay.wanted] == [pair_id(key_b, key_c)]
    relay_b, relay_c = device_b.peers[key_c].endpoint, device_c.peers[key_b].endpoint
    assert {relay_b, relay_c} == {"203.0.113.1:51821", "203.0.113.1:51822"}
    punch = b.follower.instructions[key_c].punch
    assert punch is not None and punch.endpoint == observed[key_c] and punch.at == clock[0] + 4.5

    for daemon, device, peer in ((b, device_b, key_c), (c, device_c, key_b)):
        mine = daemon.follower.instructions[peer].punch
        run_tries(daemon.backend, daemon.config, daemon.follower, punch.at)
        assert device.peers[peer].persistent_keepalive == 1 and device.peers[peer].endpoint == mine.endpoint
        device.heard[peer] = (148, punch.at + 0.1)
        run_tries(daemon.backend, daemon.config, daemon.follower, punch.at + punch.window)
        assert daemon.follower.results[peer] == (punch.id, True)
        assert device.peers[peer].persistent_keepalive == 25

    clock[0] = punch.at + punch.window + 1
    sync_all()
    assert b.follower.instructions[key_c].path == c.follower.instructions[key_b].path == "direct"
    assert relay.wanted == []
    assert device_b.peers[key_c].endpoint == observed[key_c], "the relay endpoint was never pushed back"
    assert b.status["paths"] == {key_c: "direct"}


def test_the_coordinator_relays_on_its_endpoint_host_unless_told_not_to(
    tmp_path, coordinator, monkeypatch
) -> None:
    from mesh.control.paths import AllocationWant
    from mesh.wireguard.keys import generate_private_key, public_key

    daemon, _ = member_daemon(tmp_path / "b", coordinator, monkeypatch)
    daemon.config = daemon.config.with_changes(
        role="coordinator", relay=True, coordinator_endpoint="127.0.0.1:51820", relay_ports=(42101, 42110)
    )
    relay = daemon._relay()
    try:
        assert relay is not None and relay.host == "127.0.0.1"
        a, b = sorted(public_key(generate_private_key()) for _ in range(2))
        granted = relay.grant([AllocationWant(pair_id(a, b), a, "127.0.0.1", b, "127.0.0.1")])
        assert set(granted) == {pair_id(a, b)} and all(
            42101 <= port <= 42110 for port in granted[pair_id(a, b)]
        )
        assert relay.grant([]) == {}
    finally:
        daemon.relay_service.stop()
    daemon.config = daemon.config.with_changes(relay=False)
    assert daemon._relay() is None


def test_pairs_go_to_a_relaying_member_when_the_coordinator_does_not_relay() -> None:
    from mesh.control.board import PathBoard
    from mesh.control.model import Roster, RosterEntry
    from mesh.control.report import MemberReport
    from mesh.node.pathing import MemberRelay
    from mesh.wireguard.keys import generate_private_key, public_key

    coord, a, b, relay = (public_key(generate_private_key()) for _ in range(4))
    roster = Roster(
        "m",
        "198.51.100.0/28",
        1,
        (
            RosterEntry("coord", "198.51.100.1", coord, "127.0.0.1:51820", True),
            RosterEntry("a", "198.51.100.2", a),
            RosterEntry("b", "198.51.100.3", b),
            RosterEntry("relay", "198.51.100.4", relay, "127.0.0.1:51820"),
        ),
    )
    board = PathBoard()
    board.record(relay, MemberReport(relay=True))
    planning = CoordinatorPaths(board, 2.0, None)
    device = DeviceStatus(
        None, 51820, tuple(PeerStatus(k, "127.0.0.1:40000", (), None, 0, 0, 25) for k in (a, b, relay))
    )
    planning.step(roster, device)
    assert json.loads(json.dumps(board.paths_json(a)))[b]["path"] == "pending"
    requests = board.relay_json(relay)
    assert [r["pair"] for r in requests] == [pair_id(a, b)] and board.relay_json(a) == []

    served = MemberRelay("127.0.0.1:51820", range(42201, 42211))
    try:
        from mesh.control.model import parse_relay_allocations

        served.serve(parse_relay_allocations(requests))
        ports = served.opened[pair_id(a, b)]
        board.record(relay, MemberReport(relay=True, relay_ports=served.opened))
        planning.step(roster, device)
        side_a = 0 if pair_id(a, b).startswith(a) else 1
        assert board.paths_json(a)[b]["endpoint"] == f"127.0.0.1:{ports[side_a]}"
        assert board.paths_json(b)[a]["endpoint"] == f"127.0.0.1:{ports[1 - side_a]}"
        served.serve([])
        assert served.opened == {}
    finally:
        served.stop()
