"""Tests of mesh/control/coordinator.py: a real coordinator on 127.0.0.1 facing bad input and a fuzzer.

Every refusal must be a clear 4xx message and leave the roster and the tokens unchanged.
"""

from __future__ import annotations

import base64
import json
import os
import random
import socket
import threading
import time
from dataclasses import replace

import pytest

from mesh.control.client import http_request, request_join
from mesh.control.coordinator import JOIN_MAX_BODY, start_roster_server
from mesh.control.protocol import seal_join_request
from mesh.control.token import secret_hash
from mesh.errors import MeshError
from mesh.wireguard.keys import generate_private_key, public_key
from tests.helpers.mesh_hosts import InProcessCoordinator


@pytest.fixture
def coordinator(tmp_path):
    service = InProcessCoordinator(tmp_path)
    yield service
    service.close()


def _snapshot(coordinator: InProcessCoordinator):
    return coordinator.store.roster(), coordinator.store.counts()


def _post(coordinator: InProcessCoordinator, body: bytes, path: str = "/v1/join") -> tuple[int, dict]:
    status, _, reply = http_request("127.0.0.1", coordinator.port, "POST", path, body)
    return status, json.loads(reply)


def _refused(coordinator: InProcessCoordinator, token, message: str, name: str = "joiner") -> None:
    before = _snapshot(coordinator)
    with pytest.raises(MeshError, match=message):
        request_join(token, name, public_key(generate_private_key()), None)
    assert _snapshot(coordinator) == before


def test_join_succeeds_and_changes_the_roster(coordinator) -> None:
    result = request_join(
        coordinator.invite(), "gpu-2", public_key(generate_private_key()), "192.0.2.2:51820"
    )
    assert result.member.address == "198.51.100.2"
    assert [m.name for m in coordinator.store.roster().members] == ["coord", "gpu-2"]


def test_expired_token_is_refused(coordinator) -> None:
    token = coordinator.invite()
    expired = replace(token, token_id=os.urandom(8))
    coordinator.store.add_token(expired.token_id, secret_hash(expired.secret), time.time() - 1, 1)
    _refused(coordinator, expired, "refused the join: join token has expired.*mesh invite")


def test_reused_token_is_refused(coordinator) -> None:
    token = coordinator.invite()
    request_join(token, "first", public_key(generate_private_key()), None)
    _refused(coordinator, token, "already used")


def test_forged_token_is_refused(coordinator) -> None:
    token = coordinator.invite()
    _refused(coordinator, replace(token, secret=os.urandom(32)), "failed authentication")
    _refused(coordinator, replace(token, token_id=os.urandom(8)), "unknown join token")


def test_token_for_another_coordinator_key_is_refused(coordinator) -> None:
    token = replace(coordinator.invite(), coordinator_key=public_key(generate_private_key()))
    _refused(coordinator, token, "made for coordinator key")


def test_name_collision_and_exhaustion_are_refused(tmp_path) -> None:
    small = InProcessCoordinator(tmp_path, cidr="198.51.100.0/30")
    try:
        token = small.invite(uses=3)
        _refused(small, token, "name 'coord' is already taken", name="coord")
        request_join(token, "b", public_key(generate_private_key()), None)
        _refused(small, token, "no free address left in 198.51.100.0/30")
        assert small.store.counts()["tokens_usable"] == 2
    finally:
        small.close()


def test_replayed_join_message_is_refused(coordinator) -> None:
    token = coordinator.invite(uses=5)
    envelope, _ = seal_join_request(token, "b", public_key(generate_private_key()), None)
    body = json.dumps(envelope).encode()
    assert _post(coordinator, body)[0] == 200
    before = _snapshot(coordinator)
    status, reply = _post(coordinator, body)
    assert status == 409 and "replayed join message" in reply["error"]
    assert _snapshot(coordinator) == before


def test_oversized_requests_are_refused_before_reading(coordinator) -> None:
    before = _snapshot(coordinator)
    status, reply = _post(coordinator, b"x" * (JOIN_MAX_BODY + 1))
    assert status == 413 and "limit" in reply["error"]
    with socket.create_connection(("127.0.0.1", coordinator.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/join HTTP/1.0\r\nContent-Length: 999999999999\r\n\r\n")
        assert b" 413 " in sock.recv(4096)
    assert _snapshot(coordinator) == before


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[]",
        b"null",
        b'{"v": 1}',
        b'{"v": "1"}',
        json.dumps({"v": 1, "token_id": "A" * 5000}).encode(),
    ],
)
def test_malformed_requests_get_a_clear_400(coordinator, body: bytes) -> None:
    before = _snapshot(coordinator)
    status, reply = _post(coordinator, body)
    assert 400 <= status < 500 and reply["error"]
    assert _snapshot(coordinator) == before


def test_unknown_paths_and_missing_length(coordinator) -> None:
    assert http_request("127.0.0.1", coordinator.port, "GET", "/etc/passwd")[0] == 404
    with socket.create_connection(("127.0.0.1", coordinator.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/join HTTP/1.0\r\n\r\n")
        assert b" 411 " in sock.recv(4096)


def test_simultaneous_joins_with_one_token_exactly_one_succeeds(coordinator) -> None:
    token = coordinator.invite()
    barrier = threading.Barrier(5)
    outcomes: list[str] = []

    def attempt(index: int) -> None:
        key = public_key(generate_private_key())
        barrier.wait()
        try:
            request_join(token, f"racer-{index}", key, None)
            outcomes.append("ok")
        except MeshError as error:
            outcomes.append(str(error))

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("ok") == 1, outcomes
    assert sum("already used" in o for o in outcomes) == 4
    assert len(coordinator.store.roster().members) == 2


def _mutations(valid: dict, rng: random.Random) -> bytes:
    """One hostile variant of a valid join envelope (never the valid one itself)."""
    envelope = dict(valid)
    choice = rng.randrange(9)
    field = rng.choice(sorted(valid))
    if choice == 0:  # flip bits in a binary field
        if field == "v":
            envelope["v"] = rng.choice([0, 2, -1, 1.0, 1.5, "1", None, True])
        else:
            raw = bytearray(base64.b64decode(valid[field]))
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            envelope[field] = base64.b64encode(bytes(raw)).decode()
    elif choice == 1:  # drop a field
        del envelope[field]
    elif choice == 2:  # wrong type
        envelope[field] = rng.choice([None, 0, -1, 1e308, [], {}, True, "", "💥", "=" * 10])
    elif choice == 3:  # truncate a field
        envelope[field] = str(valid[field])[: rng.randrange(len(str(valid[field])))]
    elif choice == 4:  # truncate the JSON text
        text = json.dumps(valid)
        return text[: rng.randrange(1, len(text) - 1)].encode()
    elif choice == 5:  # random bytes
        return os.urandom(rng.randrange(0, 2048))
    elif choice == 6:  # random JSON
        return json.dumps(
            rng.choice([[1, 2], {"a": {"b": [None]}}, "str", 12, {"v": 1, "ciphertext": "AAAA"}])
        ).encode()
    elif choice == 7:  # swap two fields
        other = rng.choice(sorted(valid))
        envelope[field], envelope[other] = valid[other], valid[field]
        if json.dumps(envelope) == json.dumps(valid):
            envelope["ciphertext"] = ""
    else:  # splice random bytes into the ciphertext
        raw = bytearray(base64.b64decode(valid["ciphertext"]))
        position = rng.randrange(len(raw))
        raw[position:position] = os.urandom(rng.randrange(1, 16))
        envelope["ciphertext"] = base64.b64encode(bytes(raw)).decode()
    assert json.dumps(envelope) != json.dumps(valid)
    return json.dumps(envelope).encode()


def _raw_http(coordinator: InProcessCoordinator, rng: random.Random) -> int:
    """Send a malformed HTTP request on a raw socket; return the status code or 0 if none."""
    requests = [
        os.urandom(rng.randrange(1, 400)),
        b"GARBAGE / HTTP/1.0\r\n\r\n",
        b"POST /v1/join HTTP/1.0\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/join HTTP/1.0\r\nContent-Length: 10\r\n\r\nabc",
        b"GET /v1/roster HTTP/1.0\r\nX-Shardpool-Key: " + base64.b64encode(os.urandom(32)) + b"\r\n\r\n",
        b"POST /v1/join HTTP/1.1\r\n" + b"X-A: b\r\n" * 120 + b"\r\n",
    ]
    with socket.create_connection(("127.0.0.1", coordinator.port), timeout=10) as sock:
        try:
            sock.sendall(rng.choice(requests))
            sock.shutdown(socket.SHUT_WR)
            reply = sock.recv(4096)
        except (ConnectionResetError, BrokenPipeError):
            return 0
    parts = reply.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def test_fuzz_1200_hostile_requests_never_crash_or_change_the_roster(coordinator) -> None:
    rng = random.Random(20240601)
    token = coordinator.invite(uses=2)
    request_join(token, "existing", public_key(generate_private_key()), None)
    valid, _ = seal_join_request(token, "fuzzed", public_key(generate_private_key()), None)
    before = _snapshot(coordinator)
    statuses: list[int] = []
    for index in range(1200):
        if index % 10 == 9:
            statuses.append(_raw_http(coordinator, rng))
        elif index % 10 == 8:
            headers = {
                "X-Shardpool-Key": rng.choice([coordinator.public_key, "x" * 44, ""]),
                "X-Shardpool-Mac": "00" * 32,
            }
            statuses.append(http_request("127.0.0.1", coordinator.port, "GET", "/v1/roster", b"", headers)[0])
        else:
            statuses.append(
                http_request("127.0.0.1", coordinator.port, "POST", "/v1/join", _mutations(valid, rng))[0]
            )
    assert len(statuses) == 1200
    assert all(status == 0 or 400 <= status < 500 for status in statuses), sorted(set(statuses))[-5:]
    assert sum(400 <= status < 500 for status in statuses) >= 1100
    assert _snapshot(coordinator) == before
    # Still alive and the token's remaining use was never consumed by the fuzzer.
    status, _ = _post(coordinator, json.dumps(valid).encode())
    assert status == 200
    assert [m.name for m in coordinator.store.roster().members] == ["coord", "existing", "fuzzed"]


def test_the_two_production_services_serve_only_their_own_routes(tmp_path) -> None:
    split = InProcessCoordinator(tmp_path, split=True)
    try:
        assert split.port != split.roster_port
        # The underlay join service never serves the roster, and the mesh roster service never takes joins.
        assert http_request("127.0.0.1", split.port, "GET", "/v1/roster")[0] == 404
        assert http_request("127.0.0.1", split.roster_port, "POST", "/v1/join", b"{}")[0] == 404
        assert http_request("127.0.0.1", split.port, "POST", "/v1/join", b"{}")[0] == 400
        assert http_request("127.0.0.1", split.roster_port, "GET", "/v1/roster")[0] == 401
        assert http_request("127.0.0.1", split.port, "GET", "/v1/membership")[0] == 401
    finally:
        split.close()


def test_the_roster_service_refuses_a_wildcard_address(coordinator) -> None:
    with pytest.raises(MeshError, match="refusing to listen on 0.0.0.0"):
        start_roster_server(coordinator.service, "0.0.0.0", 0)


def test_a_signed_path_is_refused_before_its_body_is_parsed(coordinator, monkeypatch) -> None:
    parsed: list[bytes] = []
    monkeypatch.setattr(coordinator.service, "_revoke", lambda member: parsed.append(b"revoke"))
    before = _snapshot(coordinator)
    status, reply = _post(coordinator, b'{"name": "coord"}', path="/v1/leave")
    assert status == 401 and "X-Shardpool-Key" in reply["error"]
    assert parsed == [] and _snapshot(coordinator) == before
