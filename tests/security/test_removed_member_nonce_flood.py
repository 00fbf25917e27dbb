"""Regression: a removed member must not be able to lock honest members out of roster sync.

Before the fix the coordinator kept one global nonce cache and recorded a request's nonce
before looking at whether its sender had been removed, so a removed member flooding
``/v1/membership`` (reachable on the underlay) filled the cache and every honest sync got 401.
"""

from __future__ import annotations

import json

import pytest

from mesh.control.client import request_join
from mesh.wireguard.keys import generate_private_key, public_key
from tests.helpers.mesh_hosts import InProcessCoordinator

CAP = 32


@pytest.fixture
def coordinator(tmp_path):
    service = InProcessCoordinator(tmp_path, nonce_cap=CAP)
    yield service
    service.close()


def _joined(coordinator: InProcessCoordinator, name: str) -> str:
    private = generate_private_key()
    request_join(coordinator.invite(), name, public_key(private), None)
    return private


def test_a_removed_members_flood_leaves_honest_syncs_working(coordinator) -> None:
    honest = _joined(coordinator, "honest")
    removed = _joined(coordinator, "removed")
    coordinator.store.revoke("removed")
    flood = [coordinator.signed_request(removed, "GET", "/v1/membership")[0] for _ in range(CAP * 4)]
    for _ in range(3):
        status, _, body = coordinator.signed_request(honest, "GET", "/v1/roster")
        assert status == 200, body
        assert [m["name"] for m in json.loads(body)["roster"]["members"]] == ["coord", "honest"]
    assert set(flood) == {403}, "every flood request is told it was removed, none is refused as a replay"


def test_a_removed_member_is_refused_on_every_route(coordinator) -> None:
    removed = _joined(coordinator, "removed")
    coordinator.store.revoke("removed")
    for method, path in (("GET", "/v1/roster"), ("GET", "/v1/membership"), ("POST", "/v1/leave")):
        status, _, body = coordinator.signed_request(removed, method, path)
        assert (status, b"removed" in body) == (403, True), (path, body)
    assert coordinator.store.counts()["revoked"] == 1


def test_a_current_member_flooding_its_own_cache_does_not_lock_out_another(coordinator) -> None:
    honest = _joined(coordinator, "honest")
    noisy = _joined(coordinator, "noisy")
    statuses = [coordinator.signed_request(noisy, "GET", "/v1/membership")[0] for _ in range(CAP + 8)]
    assert statuses.count(200) == CAP and statuses.count(401) == 8
    assert coordinator.signed_request(honest, "GET", "/v1/roster")[0] == 200
