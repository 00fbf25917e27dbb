"""Tests of mesh/daemon.py: one sync step against a real coordinator, an absent one, and after removal.

The WireGuard device is replaced by an in-memory fake here (pure bookkeeping); the real device
path is covered by tests/test_mesh_e2e.py.
"""

from __future__ import annotations

import pytest

from mesh import syncd as syncd_module
from mesh.backend import DeviceStatus, PeerConfig, PeerStatus
from mesh.client import request_join
from mesh.config import MeshConfig, save_config
from mesh.keys import generate_private_key, public_key, write_private_key
from mesh.node import load_cached_roster, save_cached_roster
from mesh.state import StatePaths
from mesh.syncd import SyncDaemon
from tests.mesh_hosts import InProcessCoordinator


class FakeDevice:
    """Keeps peers in a dict, like a WireGuard device would."""

    name = "fake"

    def __init__(self) -> None:
        self.peers: dict[str, PeerConfig] = {}

    def show(self, ifname: str) -> DeviceStatus:
        return DeviceStatus(
            None,
            51820,
            tuple(
                PeerStatus(k, p.endpoint, p.allowed_ips, None, 0, 0, p.persistent_keepalive or 0)
                for k, p in self.peers.items()
            ),
        )

    def update_peers(self, ifname: str, peers: list[PeerConfig]) -> None:
        for peer in peers:
            if peer.remove:
                self.peers.pop(peer.public_key, None)
            else:
                self.peers[peer.public_key] = peer


@pytest.fixture
def coordinator(tmp_path):
    service = InProcessCoordinator(tmp_path / "coord")
    yield service
    service.close()


def _member(
    tmp_path, coordinator: InProcessCoordinator, monkeypatch, port: int | None = None
) -> tuple[SyncDaemon, FakeDevice]:
    private = generate_private_key()
    result = request_join(coordinator.invite(), "b", public_key(private), None)
    paths = StatePaths(tmp_path / "b")
    paths.ensure()
    write_private_key(paths.private_key, private)
    save_config(
        paths,
        MeshConfig(
            role="member", mesh_id="testmesh", name="b", interface="fake0", backend="userspace", cidr=result.roster.cidr,
            address=result.member.address, public_key=public_key(private), endpoint=None, listen_port=51820, mtu=1420,
            keepalive=25, coordinator_key=coordinator.public_key, coordinator_endpoint=coordinator.endpoint,
            coordinator_address="127.0.0.1", api_port=port or coordinator.port,
        ),
    )  # fmt: skip
    save_cached_roster(paths, result.roster)
    device = FakeDevice()
    monkeypatch.setattr(syncd_module, "backend_for", lambda paths, config: device)
    return SyncDaemon(paths), device


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
