"""Regression: a NaN timestamp used to pass the freshness check (``abs(now - nan) > 120`` is false).

With a NaN time a captured request never goes stale, so freshness must demand a finite time,
on roster sync and in the join exchange alike.
"""

from __future__ import annotations

import json

import pytest

from mesh.control.client import request_join
from mesh.wireguard.keys import generate_private_key, public_key
from tests.helpers.mesh_hosts import InProcessCoordinator


@pytest.fixture
def coordinator(tmp_path):
    service = InProcessCoordinator(tmp_path)
    yield service
    service.close()


@pytest.mark.parametrize("time_text", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_a_sync_request_with_a_non_finite_time_is_refused(coordinator, time_text: str) -> None:
    member = generate_private_key()
    request_join(coordinator.invite(), "b", public_key(member), None)
    status, _, body = coordinator.signed_request(member, "GET", "/v1/roster", time_text=time_text)
    assert status == 401, body
    assert "roster" not in json.loads(body)
