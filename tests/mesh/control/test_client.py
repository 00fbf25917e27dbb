"""Tests of mesh/control/client.py: the joiner's checks and authenticated roster sync against a real coordinator."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mesh.control.client import Revoked, check_membership, fetch_roster, request_join, send_leave
from mesh.control.protocol import JoinContext, seal_join_response
from mesh.control.token import new_token
from mesh.errors import MeshError
from mesh.wireguard.keys import generate_private_key, public_key
from tests.helpers.mesh_hosts import InProcessCoordinator


@pytest.fixture
def coordinator(tmp_path):
    service = InProcessCoordinator(tmp_path)
    yield service
    service.close()


def _join(coordinator: InProcessCoordinator, name: str = "b") -> tuple[str, str]:
    private = generate_private_key()
    request_join(coordinator.invite(), name, public_key(private), "192.0.2.2:51820")
    return private, public_key(private)


def _fetch(coordinator: InProcessCoordinator, private: str):  # noqa: ANN202
    return fetch_roster("127.0.0.1", coordinator.port, private, coordinator.public_key, "testmesh")


def test_join_result_carries_address_roster_and_settings(coordinator) -> None:
    private = generate_private_key()
    result = request_join(coordinator.invite(), "b", public_key(private), "192.0.2.2:51820")
    assert result.member.address == "198.51.100.2" and result.member.endpoint == "192.0.2.2:51820"
    assert [m.name for m in result.roster.members] == ["coord", "b"]
    assert (result.mtu, result.keepalive, result.coordinator_address) == (1420, 25, "198.51.100.1")


def test_members_fetch_the_roster_with_their_key(coordinator) -> None:
    private, _ = _join(coordinator, "b")
    _join(coordinator, "c")
    assert [m.name for m in _fetch(coordinator, private).members] == ["coord", "b", "c"]


def test_unknown_keys_cannot_fetch_the_roster(coordinator) -> None:
    with pytest.raises(MeshError, match="not in this mesh"):
        _fetch(coordinator, generate_private_key())


def test_a_removed_member_is_told_so(coordinator) -> None:
    private, _ = _join(coordinator, "b")
    coordinator.store.revoke("b")
    with pytest.raises(Revoked, match="removed"):
        _fetch(coordinator, private)


def test_membership_check_tells_a_cut_off_member_it_was_removed(coordinator) -> None:
    private, key = _join(coordinator, "b")
    check_membership(coordinator.endpoint, private, coordinator.public_key, "testmesh")
    coordinator.store.revoke("b")
    with pytest.raises(Revoked, match="removed"):
        check_membership(coordinator.endpoint, private, coordinator.public_key, "testmesh")
    stranger = generate_private_key()
    with pytest.raises(MeshError, match="not in this mesh"):
        check_membership(coordinator.endpoint, stranger, coordinator.public_key, "testmesh")


def test_leave_revokes_the_caller(coordinator) -> None:
    private, key = _join(coordinator, "b")
    send_leave("127.0.0.1", coordinator.port, private, coordinator.public_key, "testmesh")
    assert [m.name for m in coordinator.store.roster().members] == ["coord"]


def test_unreachable_coordinator_is_explained() -> None:
    dead = new_token(public_key(generate_private_key()), "127.0.0.1:9", 60)
    with pytest.raises(MeshError, match="cannot reach the coordinator at 127.0.0.1:9.*TCP port 9"):
        request_join(dead, "b", public_key(generate_private_key()), None)


class _Impostor(BaseHTTPRequestHandler):
    """Answers every join with a well-formed reply sealed under a key it made up."""

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps(seal_join_response(JoinContext(bytes(32), bytes(16)), {"member": {}})).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_impostor_at_the_endpoint_is_refused(coordinator) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    try:
        token = replace(coordinator.invite(), endpoint=f"127.0.0.1:{server.server_address[1]}")
        with pytest.raises(MeshError, match="does not hold the coordinator key"):
            request_join(token, "b", public_key(generate_private_key()), None)
    finally:
        server.shutdown()
        server.server_close()
    assert [m.name for m in coordinator.store.roster().members] == ["coord"]
