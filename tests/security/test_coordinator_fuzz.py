"""Fuzz: 1,200 hostile requests against a real coordinator's join and roster services, over real sockets.

The coordinator runs its two production servers (``split=True``: joins and membership checks on
one port, rosters and leaves on another), and hypothesis sends them malformed bytes, random
methods, paths, headers and bodies, garbage JSON, oversized Content-Lengths, forged and replayed
proofs, and join envelopes sealed with wrong keys. A usable token and a current member are there
to be abused. Every reply must be a 4xx (or no reply, for bytes that never form a request head),
the kinds of refusal must be the right ones (413, 401, 409...), nothing may change the roster or
the token table, and afterwards the services still admit an honest joiner and serve an honest
sync, with no extra threads or connections left behind.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.control.auth import (
    CONTROL_PURPOSE,
    KEY_HEADER,
    MAC_HEADER,
    NONCE_HEADER,
    ROSTER_PURPOSE,
    TIME_HEADER,
    pair_key,
    sign_request,
)
from mesh.control.client import check_membership, fetch_roster, request_join
from mesh.control.coordinator import JOIN_LIMITS, JOIN_MAX_BODY, ROSTER_LIMITS, ROSTER_MAX_BODY
from mesh.control.protocol import seal_join_request
from mesh.control.report import REPORT_MAX_BODY
from mesh.control.token import JoinToken
from mesh.wireguard.keys import generate_private_key, public_key
from tests.helpers.mesh_hosts import InProcessCoordinator
from tests.helpers.raw_http import exchange

EXAMPLES = 1200
MESH_ID = "testmesh"
JOIN_PATHS = ["/v1/join", "/v1/membership"]
ROSTER_PATHS = ["/v1/roster", "/v1/report", "/v1/leave"]
ODD_PATHS = [
    "/",
    "*",
    "/v1",
    "/v1/",
    "/v1/join/",
    "/v1/roster?x=1",
    "/v1/join/../roster",
    "/v1//roster",
    "/V1/ROSTER",
    "/%2e%2e/etc/passwd",
    "/v1/roster%00",
    "//v1/membership",
    "/v1/membership?" + "a=1&" * 200,
    "http://127.0.0.1/v1/roster",
]
HEADER_NAMES = [
    "Content-Type",
    "Content-Length",
    "Transfer-Encoding",
    "Expect",
    "Connection",
    "Host",
    KEY_HEADER,
    TIME_HEADER,
    NONCE_HEADER,
    MAC_HEADER,
    "X-Shardpool-Reply-Mac",
]


# ---------------------------------------------------------------------------- the coordinator under test


@dataclass
class Recorded:
    """A request that was sent once and accepted, kept to be replayed."""

    port: int
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    sent_at: float


class Target:
    """A split coordinator with a bait token, a current member and a member that has left."""

    def __init__(self, coordinator: InProcessCoordinator) -> None:
        self.coordinator = coordinator
        self.bait: JoinToken = coordinator.invite(uses=3)  # a usable token a forged join could spend
        self.member_private = generate_private_key()
        request_join(coordinator.invite(), "member", public_key(self.member_private), None)
        self.member_key = pair_key(self.member_private, coordinator.public_key, MESH_ID, ROSTER_PURPOSE)
        self.stranger_private = generate_private_key()
        self.stranger_key = pair_key(self.stranger_private, coordinator.public_key, MESH_ID, ROSTER_PURPOSE)
        self.control_key = pair_key(self.member_private, coordinator.public_key, MESH_ID, CONTROL_PURPOSE)
        self.joined_envelope = self._join_once()
        self.left = self._leave_once()
        self.recorded = {path: self.record(path) for path in ("/v1/roster", "/v1/membership")}

    def port_for(self, path: str) -> int:
        """The port of the service that routes ``path`` (the join service for anything else)."""
        return self.coordinator.roster_port if path in ROSTER_PATHS else self.coordinator.port

    def signed(self, key: bytes, sender_private: str, method: str, path: str, body: bytes) -> dict[str, str]:
        """Headers proving ``sender_private`` sent this request (under ``key``)."""
        return sign_request(
            key,
            sender_public=public_key(sender_private),
            receiver_public=self.coordinator.public_key,
            method=method,
            path=path,
            body=body,
        )

    def record(self, path: str) -> Recorded:
        """Send one valid signed GET from the member, check it is accepted, and keep it for replays."""
        headers = self.signed(self.member_key, self.member_private, "GET", path, b"")
        port = self.port_for(path)
        status, _ = exchange(("127.0.0.1", port), build("GET", path, headers.items(), b""))
        assert status == 200, f"the recorded {path} request must be accepted once"
        return Recorded(port, "GET", path, headers, b"", time.monotonic())

    def _join_once(self) -> bytes:
        token = self.coordinator.invite()
        envelope, _ = seal_join_request(token, "joined", public_key(generate_private_key()), None)
        body = json.dumps(envelope).encode()
        assert exchange(("127.0.0.1", self.coordinator.port), build("POST", "/v1/join", [], body))[0] == 200
        return body

    def _leave_once(self) -> Recorded:
        private = generate_private_key()
        request_join(self.coordinator.invite(), "leaver", public_key(private), None)
        key = pair_key(private, self.coordinator.public_key, MESH_ID, ROSTER_PURPOSE)
        headers = self.signed(key, private, "POST", "/v1/leave", b"")
        port = self.coordinator.roster_port
        assert (
            exchange(("127.0.0.1", port), build("POST", "/v1/leave", headers.items(), b"", length=0))[0]
            == 200
        )
        return Recorded(port, "POST", "/v1/leave", headers, b"", time.monotonic())

    def state(self) -> tuple[Any, dict[str, int], dict[str, Any]]:
        """The roster (members and revision), the member and token counts, and the path reports taken."""
        store = self.coordinator.store
        reports = self.coordinator.service.board.reports(m.public_key for m in store.roster().members)
        return store.roster(), store.counts(), reports


def build(method: str, target: str, headers: Any, body: bytes, length: int | None = None) -> bytes:
    """A raw HTTP/1.1 request; ``length`` overrides the Content-Length (None: the body's, if any)."""
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers]
    declared = len(body) if length is None and body else length
    if declared is not None:
        lines.append(f"Content-Length: {declared}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def error_text(body: bytes) -> str:
    """The ``error`` of a JSON error body ("" if it has none)."""
    try:
        return str(json.loads(body).get("error", ""))
    except (ValueError, AttributeError):
        return ""


# ---------------------------------------------------------------------------- hostile requests


@dataclass(frozen=True)
class Case:
    """One hostile request: its kind, what it is made of, and the statuses that are right for it."""

    kind: str
    port_path: str  # a path naming the service to send to (see Target.port_for)
    data: Any
    expected: frozenset[int] | None = None  # None: any 4xx; 0 in the set: no reply is fine too


ANY_4XX_OR_NONE = frozenset({0} | set(range(400, 500)))
header_value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=120)
header_name = st.one_of(st.sampled_from(HEADER_NAMES), st.from_regex(r"X-[A-Za-z0-9-]{1,30}", fullmatch=True))
any_path = st.one_of(
    st.sampled_from(JOIN_PATHS + ROSTER_PATHS + ODD_PATHS),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=300).map(
        lambda text: "/" + text
    ),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=20,
)


@st.composite
def garbage_bytes(draw: st.DrawFn) -> Case:
    """Bytes that may or may not resemble HTTP, to either service."""
    prefix = draw(
        st.sampled_from([b"", b"GET / HTTP/1.1\r\n", b"POST /v1/join HTTP/1.0\r\n", b"\r\n", b"\x16\x03\x01"])
    )
    return Case(
        "garbage",
        draw(st.sampled_from(["/v1/join", "/v1/roster"])),
        prefix + draw(st.binary(max_size=2048)),
        ANY_4XX_OR_NONE,
    )


@st.composite
def random_request(draw: st.DrawFn) -> Case:
    """A well-formed request with a random method, path, headers and body."""
    method = draw(
        st.one_of(
            st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "TRACE", "CONNECT"]),
            st.from_regex(r"[A-Z]{1,16}", fullmatch=True),
        )
    )
    path = draw(any_path)
    headers = draw(st.lists(st.tuples(header_name, header_value), max_size=12))
    body = draw(st.binary(max_size=4096))
    headers = [(name, value) for name, value in headers if name.lower() != "content-length"]
    return Case("random", draw(st.sampled_from(["/v1/join", "/v1/roster"])), (method, path, headers, body))


@st.composite
def garbage_join(draw: st.DrawFn) -> Case:
    """POST /v1/join with a body that is not a join envelope (random JSON, text or bytes)."""
    body = draw(
        st.one_of(
            json_values.map(lambda value: json.dumps(value).encode()),
            st.dictionaries(
                st.sampled_from(["v", "token_id", "ephemeral", "nonce", "ciphertext", "x"]),
                json_values,
                max_size=6,
            ).map(lambda value: json.dumps(value).encode()),
            st.text(max_size=500).map(str.encode),
            st.binary(max_size=2048),
        )
    )
    return Case("garbage_json", "/v1/join", body, frozenset({400, 403}))


@st.composite
def oversized(draw: st.DrawFn) -> Case:
    """A request head declaring a body over the route's cap (the body is never sent)."""
    path = draw(st.sampled_from(JOIN_PATHS + ROSTER_PATHS))
    cap = {"/v1/join": JOIN_MAX_BODY, "/v1/report": REPORT_MAX_BODY}.get(path, ROSTER_MAX_BODY)
    length = draw(st.one_of(st.integers(cap + 1, 2 * cap), st.integers(cap + 1, 10**18)))
    method = "GET" if path in ("/v1/membership", "/v1/roster") else "POST"
    return Case("oversized", path, (method, path, length), frozenset({413}))


FORGERIES = [
    "stranger",  # a well-signed request from a key that is not in the mesh
    "random_mac",  # the member's key with a MAC it did not compute
    "other_request",  # a MAC for a different method, path or body
    "tampered_body",  # a valid proof with the body changed afterwards
    "stale",  # a correct MAC over a time outside the allowed skew
    "other_purpose",  # signed with the member's key for the agents' channel
    "garbled",  # random text in one of the proof headers
    "duplicate",  # one proof header sent twice
    "missing",  # one proof header left out
]


@st.composite
def forged(draw: st.DrawFn) -> Case:
    """A signed-path request whose proof is forged, stale, garbled or for something else."""
    path = draw(st.sampled_from(["/v1/roster", "/v1/leave", "/v1/membership", "/v1/report"]))
    method = "POST" if path in ("/v1/leave", "/v1/report") else "GET"
    forgery = draw(st.sampled_from(FORGERIES))
    params = {
        "forgery": forgery,
        "method": method,
        "path": path,
        "body": draw(st.binary(max_size=64)) if method == "POST" else b"",
        "skew": draw(st.one_of(st.floats(121, 1e7), st.floats(-1e7, -121))),
        "header": draw(st.sampled_from([KEY_HEADER, TIME_HEADER, NONCE_HEADER, MAC_HEADER])),
        "value": draw(header_value),
        "other": draw(
            st.sampled_from([("POST", "/v1/leave"), ("GET", "/v1/roster"), ("GET", "/v1/membership")])
        ),
    }
    return Case("forged", path, params, frozenset({401}))


@st.composite
def replayed(draw: st.DrawFn) -> Case:
    """A replay of an accepted request (a sync, a membership check, a leave or a join), with headers
    that no proof covers added (``X-...``, so the request differs on the wire but not in its proof)."""
    which = draw(st.sampled_from(["/v1/roster", "/v1/membership", "leave", "join"]))
    noise = draw(
        st.lists(st.tuples(st.from_regex(r"X-[A-Za-z0-9]{1,20}", fullmatch=True), header_value), max_size=4)
    )
    if which == "leave":
        return Case("replay", "/v1/leave", (which, noise), frozenset({403}))
    if which == "join":
        return Case("replay", "/v1/join", (which, noise), frozenset({409}))
    return Case("replay", which, (which, noise), frozenset({401}))


@st.composite
def wrong_key_join(draw: st.DrawFn) -> Case:
    """A well-formed join envelope sealed with a wrong secret, token id or coordinator key."""
    wrong = draw(st.sampled_from(["secret", "token_id", "coordinator_key", "all"]))
    name = draw(st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True))
    return Case("wrong_key_join", "/v1/join", (wrong, name), frozenset({403}))


hostile_cases = st.one_of(
    garbage_bytes(), random_request(), garbage_join(), oversized(), forged(), replayed(), wrong_key_join()
)


def forged_request(target: Target, params: dict[str, Any]) -> bytes:
    """Build the raw request of a ``forged`` case."""
    forgery, method, path, body = params["forgery"], params["method"], params["path"], params["body"]
    member = (target.member_key, target.member_private)
    if forgery == "stranger":
        headers = target.signed(target.stranger_key, target.stranger_private, method, path, body)
    elif forgery == "other_purpose":
        headers = target.signed(target.control_key, target.member_private, method, path, body)
    elif forgery == "other_request":
        other_method, other_path = params["other"]
        if (other_method, other_path) == (method, path):
            body = body + b"x"
        headers = target.signed(*member, other_method, other_path, b"")
    elif forgery == "stale":
        key, private = member
        headers = sign_request(
            key,
            sender_public=public_key(private),
            receiver_public=target.coordinator.public_key,
            method=method,
            path=path,
            body=body,
            now=max(0.0, time.time() + params["skew"]),
        )
    else:
        headers = target.signed(*member, method, path, body)
    items = list(headers.items())
    if forgery == "random_mac":
        items = [(k, os.urandom(32).hex() if k == MAC_HEADER else v) for k, v in items]
    elif forgery == "tampered_body":
        body = body + b"!"
    elif forgery == "garbled":
        items = [(k, params["value"] if k == params["header"] else v) for k, v in items]
        if dict(items) == headers:
            items = [(k, v + "=" if k == params["header"] else v) for k, v in items]
    elif forgery == "duplicate":
        items.append((params["header"], headers[params["header"]]))
    elif forgery == "missing":
        items = [(k, v) for k, v in items if k != params["header"]]
    return build(method, path, items, body, length=len(body))


def wrong_key_envelope(target: Target, wrong: str, name: str) -> bytes:
    """A join envelope like an honest one, but sealed with a wrong secret, token id or coordinator key."""
    token = target.bait
    if wrong in ("secret", "all"):
        token = replace(token, secret=os.urandom(len(token.secret)))
    if wrong in ("token_id", "all"):
        token = replace(token, token_id=os.urandom(len(token.token_id)))
    if wrong in ("coordinator_key", "all"):
        token = replace(token, coordinator_key=public_key(generate_private_key()))
    envelope, _ = seal_join_request(token, name, public_key(generate_private_key()), None)
    return json.dumps(envelope).encode()


def replay_request(target: Target, which: str) -> Recorded | bytes:
    """The recorded request to replay (recorded again if it is getting near the replay window's edge)."""
    if which == "join":
        return target.joined_envelope
    if which == "leave":
        return target.left
    if time.monotonic() - target.recorded[which].sent_at > 60:
        target.recorded[which] = target.record(which)
    return target.recorded[which]


def send(target: Target, case: Case) -> tuple[int, bytes]:
    """Send one hostile case to the service it names; return the status (0: no reply) and body."""
    port = target.port_for(case.port_path)
    if case.kind == "garbage":
        return exchange(("127.0.0.1", port), case.data)
    if case.kind == "random":
        method, path, headers, body = case.data
        return exchange(("127.0.0.1", port), build(method, path, headers, body))
    if case.kind == "garbage_json":
        return exchange(("127.0.0.1", port), build("POST", "/v1/join", [], case.data, length=len(case.data)))
    if case.kind == "oversized":
        method, path, length = case.data
        return exchange(("127.0.0.1", port), build(method, path, [], b"", length=length))
    if case.kind == "forged":
        return exchange(("127.0.0.1", port), forged_request(target, case.data))
    if case.kind == "wrong_key_join":
        return exchange(
            ("127.0.0.1", port), build("POST", "/v1/join", [], wrong_key_envelope(target, *case.data))
        )
    which, noise = case.data
    recorded = replay_request(target, which)
    if isinstance(recorded, bytes):
        return exchange(("127.0.0.1", port), build("POST", "/v1/join", noise, recorded))
    headers = [*recorded.headers.items(), *noise]
    return exchange(
        ("127.0.0.1", recorded.port), build(recorded.method, recorded.path, headers, recorded.body, length=0)
    )


# ---------------------------------------------------------------------------- the test


def _thread_cap() -> int:
    return 2 + JOIN_LIMITS.handler_threads + ROSTER_LIMITS.handler_threads  # two loops and two pools


@pytest.mark.slow
def test_hostile_requests_never_crash_leak_or_change_the_roster(tmp_path) -> None:
    threads_before = set(threading.enumerate())
    coordinator = InProcessCoordinator(tmp_path, split=True)
    try:
        target = Target(coordinator)
        before = target.state()
        seen: Counter[str] = Counter()

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(case=hostile_cases)
        def hostile(case: Case) -> None:
            status, body = send(target, case)
            seen[case.kind] += 1
            assert status < 500, f"{case.kind} got {status}: {body[:300]!r}"
            expected = case.expected or ANY_4XX_OR_NONE - {0}
            assert status in expected, (
                f"{case.kind} got {status}, wanted one of {sorted(expected)}: {body[:300]!r}"
            )
            if case.kind == "replay" and case.data[0] in ("/v1/roster", "/v1/membership"):
                assert "replay" in error_text(body), body
            if case.kind == "replay" and case.data[0] == "leave":
                assert json.loads(body)["removed"] is True
            assert len(threading.enumerate()) <= len(threads_before) + _thread_cap()

        hostile()
        assert sum(seen.values()) >= 1000, seen
        assert (
            min(
                seen[kind]
                for kind in (
                    "garbage",
                    "random",
                    "garbage_json",
                    "oversized",
                    "forged",
                    "replay",
                    "wrong_key_join",
                )
            )
            >= 20
        ), seen
        assert target.state() == before, "a hostile request changed the roster or the token table"

        # Still serving: an honest joiner spends the bait token, syncs, and is a member.
        private = generate_private_key()
        request_join(target.bait, "honest", public_key(private), None)
        roster = fetch_roster("127.0.0.1", coordinator.roster_port, private, coordinator.public_key, MESH_ID)
        assert [m.name for m in roster.members] == ["coord", "member", "joined", "honest"]
        check_membership(coordinator.endpoint, private, coordinator.public_key, MESH_ID)
        deadline = time.monotonic() + 5
        while (coordinator.server.open_connections or coordinator.roster_server.open_connections) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert coordinator.server.open_connections == 0 and coordinator.roster_server.open_connections == 0
    finally:
        coordinator.close()
    assert set(threading.enumerate()) == threads_before, "the servers left threads behind"
