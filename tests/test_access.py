"""Tests of shardpool/access.py: who may talk to the agent and the file server.

The allowlist is checked against the peer address of each connection, refreshed from the mesh
roster at most every ``refresh_s``; a member removed from the roster is refused afterwards, and a
roster that cannot be read refuses everyone (fails closed).
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import pytest

from shardpool.access import (
    GuardedHandler,
    GuardedHTTPServer,
    MemberAllowlist,
    mesh_member_addresses,
    start_in_thread,
)
from shardpool.errors import ShardpoolError


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_allowlist_refreshes_at_most_every_refresh_s_and_drops_removed_members() -> None:
    members = {"10.77.0.1", "10.77.0.2"}
    calls = []

    def fetch() -> set[str]:
        calls.append(1)
        return set(members)

    clock = _Clock()
    allowlist = MemberAllowlist(fetch, refresh_s=2.0, clock=clock)
    assert allowlist.allows("10.77.0.2") and allowlist.allows("10.77.0.1")
    assert not allowlist.allows("10.77.0.3") and not allowlist.allows("192.0.2.7")
    assert len(calls) == 1
    members.discard("10.77.0.2")
    clock.now += 1.9
    assert allowlist.allows("10.77.0.2"), "within refresh_s the old roster is still used"
    assert len(calls) == 1
    clock.now += 0.2
    assert not allowlist.allows("10.77.0.2"), "the removed member is refused after the refresh"
    assert allowlist.allows("10.77.0.1")
    assert len(calls) == 2


def test_allowlist_fails_closed_when_the_roster_cannot_be_read_and_recovers() -> None:
    state = {"broken": True}

    def fetch() -> set[str]:
        if state["broken"]:
            raise OSError("roster.json: permission denied")
        return {"10.77.0.1"}

    clock = _Clock()
    allowlist = MemberAllowlist(fetch, refresh_s=2.0, clock=clock)
    assert not allowlist.allows("10.77.0.1")
    assert allowlist.last_error and "permission denied" in allowlist.last_error
    state["broken"] = False
    clock.now += 2.0
    assert allowlist.allows("10.77.0.1")
    assert allowlist.last_error is None


def test_allowlist_matches_ipv4_mapped_ipv6_and_ignores_garbage() -> None:
    allowlist = MemberAllowlist.fixed({"10.77.0.5", "fd00::5"})
    assert allowlist.allows("::ffff:10.77.0.5")
    assert allowlist.allows("fd00:0::5")
    assert not allowlist.allows("not-an-ip")
    assert not allowlist.allows("")


def _member_state(root: Path, addresses: dict[str, str]) -> None:
    """A member's mesh state (settings + cached roster), with no interface, as after `mesh down`."""
    from mesh.config import MeshConfig, save_config
    from mesh.model import Roster, RosterEntry
    from mesh.node import save_cached_roster
    from mesh.state import StatePaths

    paths = StatePaths(root)
    paths.ensure()
    keys = {name: (name[0] * 43 + "=") for name in addresses}
    config = MeshConfig(
        role="member", mesh_id="abc", name="b", interface="sptest9", backend="userspace", cidr="10.77.0.0/24",
        address=addresses["b"], public_key=keys["b"], endpoint=None, listen_port=51820, mtu=1420, keepalive=25,
        coordinator_key=keys["a"], coordinator_endpoint="192.0.2.1:51820", coordinator_address=addresses["a"],
        api_port=51820,
    )  # fmt: skip
    save_config(paths, config)
    entries = tuple(RosterEntry(n, a, keys[n], None, n == "a") for n, a in addresses.items())
    save_cached_roster(paths, Roster("abc", "10.77.0.0/24", len(entries), entries))


def test_mesh_member_addresses_reads_the_roster_and_sees_removals(tmp_path: Path) -> None:
    _member_state(tmp_path, {"a": "10.77.0.1", "b": "10.77.0.2", "c": "10.77.0.3"})
    fetch = mesh_member_addresses(tmp_path)
    assert fetch() == {"10.77.0.1", "10.77.0.2", "10.77.0.3"}
    _member_state(tmp_path, {"a": "10.77.0.1", "b": "10.77.0.2"})
    assert fetch() == {"10.77.0.1", "10.77.0.2"}
    allowlist = MemberAllowlist(mesh_member_addresses(tmp_path / "nowhere"))
    assert not allowlist.allows("10.77.0.1")
    assert "no mesh state" in (allowlist.last_error or "")


class _Echo(GuardedHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.dispatch(lambda: self.send_json(200, {"peer": self.client_address[0]}))


def _get(url_host: str, port: int, source: str | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(
        url_host, port, timeout=5, source_address=(source, 0) if source else None
    )
    try:
        connection.request("GET", "/")
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_server_checks_the_peer_address_of_each_connection_live() -> None:
    members = {"127.0.0.2"}
    allowlist = MemberAllowlist(lambda: set(members), refresh_s=0.05)
    server = GuardedHTTPServer("127.0.0.1", 0, _Echo, allowlist)
    thread = start_in_thread(server, "test")
    try:
        port = server.server_address[1]
        status, body = _get("127.0.0.1", port)  # source 127.0.0.1: not a member
        assert status == 403 and "127.0.0.1 is not a current member" in body["error"]
        status, body = _get("127.0.0.1", port, source="127.0.0.2")
        assert (status, body) == (200, {"peer": "127.0.0.2"})
        members.clear()  # removed from the mesh
        time.sleep(0.1)
        status, _ = _get("127.0.0.1", port, source="127.0.0.2")
        assert status == 403
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "example.org"])
def test_server_refuses_to_listen_on_wildcard_or_names(host: str) -> None:
    with pytest.raises(ShardpoolError, match="listen"):
        GuardedHTTPServer(host, 0, _Echo, MemberAllowlist.fixed({"127.0.0.1"}))
