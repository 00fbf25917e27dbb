"""Regression: flipping a sync reply's status from 200 to 403 on the wire made a member drop every peer.

The reply MAC covered only the body, so an on-path attacker (the membership check crosses the
underlay) could turn "you are a member" into "you were removed". Now the MAC covers the status,
and a member acts on "removed" only when the coordinator's pairwise key proves it.
"""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers.mesh_hosts import InProcessCoordinator, member_daemon


class StatusFlippingProxy:
    """A TCP relay to ``upstream`` that rewrites every reply's "200 OK" status line to "403 Forbidden"."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flipped = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5) as upstream:
            client.settimeout(5)

            def forward_request() -> None:
                try:
                    while data := client.recv(65536):
                        upstream.sendall(data)
                except OSError:
                    pass

            threading.Thread(target=forward_request, daemon=True).start()
            reply = _one_reply(upstream)
            for version in (b"HTTP/1.0", b"HTTP/1.1"):
                if reply.startswith(version + b" 200 OK\r\n"):
                    reply = version + b" 403 Forbidden\r\n" + reply[len(version + b" 200 OK\r\n") :]
                    self.flipped += 1
            client.sendall(reply)

    def close(self) -> None:
        """Stop accepting connections."""
        self.listener.close()


def _one_reply(upstream: socket.socket) -> bytes:
    """The raw bytes of one reply (head and Content-Length body), read without waiting for a close."""
    reply = b""
    try:
        while b"\r\n\r\n" not in reply and (data := upstream.recv(65536)):
            reply += data
        head, _, body = reply.partition(b"\r\n\r\n")
        found = re.search(rb"(?im)^content-length:\s*(\d+)\s*$", head)
        length = int(found.group(1)) if found else 0
        while len(body) < length and (data := upstream.recv(65536)):
            body += data
        return head + b"\r\n\r\n" + body
    except OSError:
        return reply


class _UnsignedRefusal(BaseHTTPRequestHandler):
    """Something at the coordinator's address that answers every request with an unsigned "removed"."""

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        body = b'{"error": "revoked", "removed": true, "message": "this machine was removed from the mesh"}'
        self.send_response(403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def coordinator(tmp_path):
    service = InProcessCoordinator(tmp_path / "coord")
    yield service
    service.close()


@pytest.fixture
def proxy(coordinator):
    relay = StatusFlippingProxy(coordinator.port)
    yield relay
    relay.close()


def test_a_flipped_roster_reply_does_not_make_a_member_drop_its_peers(
    tmp_path, coordinator, proxy, monkeypatch
) -> None:
    daemon, device = member_daemon(tmp_path / "b", coordinator, monkeypatch, api_port=proxy.port)
    assert daemon.step() is True
    assert proxy.flipped == 1
    assert set(device.peers) == {coordinator.public_key}
    assert daemon.status.get("revoked") is None
    assert "coordinator unreachable" in str(daemon.status["last_error"])


def test_a_flipped_membership_reply_does_not_make_a_cut_off_member_drop_its_peers(
    tmp_path, coordinator, proxy, monkeypatch
) -> None:
    daemon, device = member_daemon(
        tmp_path / "b", coordinator, monkeypatch, api_port=9, coordinator_endpoint=f"127.0.0.1:{proxy.port}"
    )
    assert daemon.step() is True
    assert proxy.flipped == 1
    assert set(device.peers) == {coordinator.public_key}
    assert daemon.status.get("revoked") is None


def test_an_unsigned_removed_answer_is_treated_as_unreachable(tmp_path, coordinator, monkeypatch) -> None:
    impostor = ThreadingHTTPServer(("127.0.0.1", 0), _UnsignedRefusal)
    threading.Thread(target=impostor.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    try:
        port = impostor.server_address[1]
        daemon, device = member_daemon(
            tmp_path / "b", coordinator, monkeypatch, api_port=port, coordinator_endpoint=f"127.0.0.1:{port}"
        )
        assert daemon.step() is True
    finally:
        impostor.shutdown()
        impostor.server_close()
    assert set(device.peers) == {coordinator.public_key}
    assert daemon.status.get("revoked") is None


@pytest.mark.parametrize("cut_off", [False, True])
def test_a_genuinely_removed_member_still_learns_it(
    tmp_path, coordinator, monkeypatch, cut_off: bool
) -> None:
    daemon, device = member_daemon(tmp_path / "b", coordinator, monkeypatch)
    assert daemon.step() is True
    assert set(device.peers) == {coordinator.public_key}
    coordinator.store.revoke("b")
    if cut_off:  # the mesh no longer carries its sync: it must learn it from the underlay membership check
        daemon.config = replace(daemon.config, api_port=9)
    assert daemon.step() is False
    assert device.peers == {}
    assert daemon.status["revoked"] is True
