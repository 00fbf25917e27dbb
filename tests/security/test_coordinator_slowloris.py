"""Slowloris against the coordinator's join endpoint: honest joins and syncs must still get through.

The join service is the one coordinator service on the underlay, so anyone can open connections
to it. With 2,000 idle or trickling connections held open on it (from 40 loopback source
addresses, 50 each, under the per-source cap, so the attack is really held and not refused), an
honest joiner must still be admitted, and then sync the roster and check its membership, each
within 10 s. Only 127.0.0.x addresses are used.
"""

from __future__ import annotations

import threading
import time

import pytest

from mesh.control.client import check_membership, fetch_roster, request_join
from mesh.control.coordinator import JOIN_LIMITS
from mesh.wireguard.keys import generate_private_key, public_key
from tests.helpers.mesh_hosts import InProcessCoordinator
from tests.helpers.slowloris import SlowlorisAttack, loopback_sources, raise_fd_limit

pytestmark = pytest.mark.slow

ATTACKERS = 2000
SOURCES = loopback_sources(40)
HONEST_LIMIT_S = 10.0


def _timed(what: str, action):  # noqa: ANN001, ANN202 - any callable, its result
    started = time.monotonic()
    result = action()
    elapsed = time.monotonic() - started
    assert elapsed < HONEST_LIMIT_S, f"{what} took {elapsed:.1f} s under attack"
    return result


def test_an_honest_join_and_sync_complete_while_two_thousand_connections_hold_the_join_endpoint(
    tmp_path,
) -> None:
    assert ATTACKERS // len(SOURCES) <= JOIN_LIMITS.max_connections_per_source
    raise_fd_limit(2 * ATTACKERS + 200)
    threads_before = set(threading.enumerate())
    coordinator = InProcessCoordinator(tmp_path, split=True)
    try:
        token = coordinator.invite()
        head_start = b"POST /v1/join HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\nX-Slow: "
        with SlowlorisAttack(f"http://{coordinator.endpoint}", ATTACKERS, SOURCES, head_start):
            deadline = time.monotonic() + 5.0
            while coordinator.server.open_connections < ATTACKERS and time.monotonic() < deadline:
                time.sleep(0.05)
            assert coordinator.server.open_connections >= ATTACKERS, (
                "the attack connections must be held open"
            )

            private = generate_private_key()
            joined = _timed(
                "an honest join", lambda: request_join(token, "honest", public_key(private), None)
            )
            assert joined.member.name == "honest"
            roster = _timed(
                "an honest roster sync",
                lambda: fetch_roster(
                    "127.0.0.1", coordinator.roster_port, private, coordinator.public_key, "testmesh"
                ),
            )
            assert [member.name for member in roster.members] == ["coord", "honest"]
            _timed(
                "an honest membership check on the join endpoint",
                lambda: check_membership(coordinator.endpoint, private, coordinator.public_key, "testmesh"),
            )
            assert coordinator.server.open_connections >= ATTACKERS, "the attack was still under way"
    finally:
        coordinator.close()
    assert set(threading.enumerate()) == threads_before
