"""Tests of mesh/daemon.py: one sync step against a real coordinator, an absent one, and after removal.

The WireGuard device is replaced by an in-memory fake here (pure bookkeeping); the real device
path is covered by tests/mesh/test_e2e.py.
"""

from __future__ import annotations

import pytest

from mesh.control.client import request_join
from mesh.node.member import load_cached_roster
from mesh.wireguard.keys import generate_private_key, public_key
from tests.helpers.mesh_hosts import InProcessCoordinator, member_daemon


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
