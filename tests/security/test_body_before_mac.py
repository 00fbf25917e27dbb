"""A request's MAC is checked before its body is read: a bogus MAC cannot hold the agent's handlers.

Member public keys are public (every roster has them), so a well-formed proof with a bogus MAC is
something any local process on a member can send. Before issue 39 the agent checked only the
proof's format before reading a streamed body of up to 32 MiB in a handler thread, so a few such
requests trickling their bodies held every handler. Now the MAC covers the body's declared
SHA-256 and is verified before the first body byte is read; the body must then match the
declaration. Real agent, real sockets.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from mesh.control.auth import BODY_HEADER, CONTROL_PURPOSE, MAC_HEADER, pair_key, sign_request
from mesh.http.server import Limits
from mesh.wireguard.keys import public_key
from shardpool.agent.mesh_routes import MAX_ECHO_BYTES
from shardpool.agent.service import Agent
from tests.helpers.agents import AGENT_KEY, LAUNCHER_KEY, MESH_ID, make_agent, shared_dir, signed

HANDLERS = 2
PREFIX = 64 * 1024
REPLY_WITHIN_S = 5.0


@pytest.fixture
def agent() -> Iterator[Agent]:
    with (
        shared_dir() as shared,
        make_agent(shared / "work", None, limits=Limits(handler_threads=HANDLERS)) as running,
    ):
        yield running


def _proof(body_digest_of: bytes, path: str = "/v1/echo") -> dict[str, str]:
    pair = pair_key(LAUNCHER_KEY, public_key(AGENT_KEY), MESH_ID, CONTROL_PURPOSE)
    return sign_request(
        pair, sender_public=public_key(LAUNCHER_KEY), receiver_public=public_key(AGENT_KEY),
        method="POST", path=path, body=body_digest_of,
    )  # fmt: skip


def _open(agent: Agent, headers: dict[str, str], length: int, prefix: bytes) -> socket.socket:
    """Send a request head declaring ``length`` body bytes, then only ``prefix`` of the body."""
    host, port = agent.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=REPLY_WITHIN_S)
    lines = ["POST /v1/echo HTTP/1.1", "Host: x", f"Content-Length: {length}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + prefix)
    return sock


def _reply(sock: socket.socket) -> tuple[int, dict[str, object], bool]:
    """Status and JSON body of the reply, and whether the server then closed the connection."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
        closed = True
    except TimeoutError:
        closed = False
    head, _, body = data.partition(b"\r\n\r\n")
    assert head, f"no reply within {REPLY_WITHIN_S} s: the server is waiting for the body"
    return int(head.split()[1]), json.loads(body), closed


def test_a_bogus_mac_32_mib_body_is_refused_before_its_body_is_read(agent: Agent) -> None:
    headers = _proof(b"\0" * MAX_ECHO_BYTES)
    headers[MAC_HEADER] = "0" * 64  # the attacker knows the sender's public key, not the pairwise key
    attackers = [_open(agent, headers, MAX_ECHO_BYTES, b"\0" * PREFIX) for _ in range(HANDLERS + 1)]
    try:
        assert signed(agent.url, "GET", "/v1/health", timeout=REPLY_WITHIN_S)[0] == 200
        for sock in attackers:
            status, reply, closed = _reply(sock)
            assert status == 401 and "MAC from a is wrong" in str(reply["error"]), reply
            assert closed, "the unread body is dropped with the connection, never drained"
    finally:
        for sock in attackers:
            sock.close()


@pytest.mark.slow
def test_honest_large_bodies_pass_and_a_changed_or_undeclared_body_is_refused(agent: Agent) -> None:
    assert signed(agent.url, "POST", "/v1/echo", raw=b"x" * MAX_ECHO_BYTES, timeout=60) == (
        200,
        {"bytes": MAX_ECHO_BYTES},
    )
    body = b"y" * (4 * 2**20)
    changed = _open(agent, _proof(body), len(body), b"z" + body[1:])
    status, reply, _ = _reply(changed)
    changed.close()
    assert status == 401 and BODY_HEADER in str(reply["error"]), reply
    undeclared = _proof(body)
    del undeclared[BODY_HEADER]
    sock = _open(agent, undeclared, len(body), body[:PREFIX])
    status, reply, _ = _reply(sock)
    sock.close()
    assert status == 401 and f"no {BODY_HEADER}" in str(reply["error"]), reply
